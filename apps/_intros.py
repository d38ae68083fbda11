"""The few lines each page opens with: what it shows, the paper, how to read the main plot,
and the one thing to try first.

`INTROS` maps a page's slug (as in `apps.gallery.VIEWS`) to its `Intro`; `intro_pane(slug)`
renders it as a small Markdown block (CSS class ``page-intro``) for the top of the page.
The paper link is an arXiv title search, so it always finds the paper; the docs link names
the file under ``docs/`` that holds the method and the measured results.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote_plus

import panel as pn

__all__ = ["Intro", "INTROS", "intro_pane", "paper_url"]


@dataclass(frozen=True)
class Intro:
    """What a page says about itself before anything else."""

    shows: str           # one sentence: what the page shows
    paper: str           # authors (venue), or the method's origin
    title: str           # the paper's title, for the link
    read: str            # how to read the main plot
    try_first: str       # the one thing to do first
    doc: str = ""        # docs/<file> with the method and results


def paper_url(title: str) -> str:
    """An arXiv search for ``title`` (finds the paper without a hard-coded identifier)."""
    return f"https://arxiv.org/search/?searchtype=title&query={quote_plus(title)}"


INTROS: dict[str, Intro] = {
    "lens": Intro(
        shows="What each layer would predict for the next token if the model stopped there, "
              "and how adding a steering vector to one layer changes it.",
        paper="nostalgebraist (2020), the logit lens; steering by Turner et al. (2023)",
        title="Steering Language Models With Activation Engineering",
        read="Rows are layers, columns are input positions; each cell is the layer's top "
             "token there, coloured by its probability. Read a column upwards to see the "
             "answer form.",
        try_first="Type a prompt in the sidebar and press Enter, then move the steering "
                  "strength slider and watch the top rows change.",
        doc="README.md"),
    "saturation": Intro(
        shows="For every token of a text, the layer from which each of the final top-k "
              "tokens keeps its rank (its saturation layer), and an early exit built on it.",
        paper="Lioubashevski, Schlank, Stanovsky & Goldstein (ICML 2025)",
        title="Looking Beyond the Top-1: Transformers Determine Top Tokens in Order",
        read="The token strip is coloured by the layer where the top-1 token is decided; "
             "a staircase that rises with rank (s1 < s2 < ...) is the paper's finding. "
             "With edits in the sidebar, the prompt's token view shows the edited run under "
             "the clean one.",
        try_first="Press Analyse if no stored result opens (about a minute on SmolLM2), then "
                  "click a token in the strip to see its layer x rank table and staircase.",
        doc="docs/saturation.md"),
    "conflicts": Intro(
        shows="Which attention heads push the model towards its memorised answer and which "
              "towards the answer in the context, and the JuICE dual-run intervention on them.",
        paper="Li, Chen & Tong (ICML 2025), JuICE",
        title="Taming Knowledge Conflicts in Language Models",
        read="The heatmap is each head's direct push on logit(memory) minus logit(context): "
             "red heads favour memory, blue heads the context. The bars show both answers' "
             "probabilities before and after the intervention (and on the edited model, "
             "with edits in the sidebar).",
        try_first="Press 'Pick top heads for the direction', then raise α_l (enhance) "
                  "and watch the bars.",
        doc="docs/conflicts.md"),
    "icl-heads": Intro(
        shows="Induction heads against function-vector (FV) heads, what ablating each kind "
              "does to few-shot accuracy, and where the task is encoded.",
        paper="Yin & Steinhardt (ICML 2025); function vectors by Todd et al. (2024)",
        title="Which Attention Heads Matter for In-Context Learning?",
        read="Each dot is a head: right means a strong induction score, up a strong FV "
             "score. In the ablation plot a curve that falls fast means those heads matter.",
        try_first="Press Compute scores (its label says how long it takes here), click a dot "
                  "to see that head's attention, then change the task.",
        doc="docs/icl_heads.md"),
    "itda": Intro(
        shows="A dictionary built from the model's own activations (ITDA), how its size "
              "and error depend on tau, its atoms, and layer-by-layer similarity to a second "
              "model.",
        paper="Leask, Nanda & Al Moubayed (ICML 2025)",
        title="Inference-Time Decomposition of Activations (ITDA)",
        read="The curves show dictionary size, reconstruction error and L0 against tau (the "
             "line marks the current tau). In the heatmap a bright diagonal means the two "
             "models' layers correspond.",
        try_first="Move the tau slider, then pick an atom to see the tokens that use it.",
        doc="docs/representations.md"),
    "neuron-eval": Intro(
        shows="Every metric that scores an explanation of a unit, and the two sanity checks "
              "(missing and extra labels) that a sound metric must pass.",
        paper="Oikarinen, Yan & Weng (ICML 2025)",
        title="Evaluating Neuron Explanations: A Unified Framework with Sanity Checks",
        read="The bars show how much each metric's score drops when the explanation loses "
             "half its positives or gains as many false ones; a metric passes only if both "
             "bars fall below zero.",
        try_first="Change the perturbation seed and watch which metrics stay consistent.",
        doc="docs/representations.md"),
    "parity": Intro(
        shows="A small RNN learning the parity of bit strings, and the automaton its hidden "
              "states form as it trains.",
        paper="van Rossem & Saxe (ICML 2025)",
        title="Algorithm Development in Neural Networks: Insights from the Streaming "
              "Parity Task",
        read="Early in training the hidden states spread into a tree; later they merge "
             "until two states remain, and from then on accuracy holds at any string length.",
        try_first="Drag the training-step slider from left to right.",
        doc="docs/dynamics.md"),
    "linear-icl": Intro(
        shows="Multi-head softmax attention trained on in-context linear regression, and the "
              "head pattern it settles into.",
        paper="He, Pan, Chen & Yang (ICML 2025)",
        title="In-Context Linear Regression Demystified: Training Dynamics and Mechanistic "
              "Interpretability of Multi-Head Softmax Attention",
        read="The KQ heatmaps become a scaled identity and the OV vectors read only y; heads "
             "pair up with opposite signs, which computes one step of debiased gradient "
             "descent.",
        try_first="Drag the training-step slider and compare one head with several.",
        doc="docs/dynamics.md"),
    "task-emergence": Intro(
        shows="A small transformer trained on a mixture of regression tasks, and when its "
              "query token comes to encode which task a prompt uses.",
        paper="Han, Song, Gore & Agrawal (ICML 2025)",
        title="Emergence and Effectiveness of Task Vectors in In-Context Learning: An "
              "Encoder-Decoder Perspective",
        read="Task decodability (TD) is how well a classifier reads a prompt's task off a "
             "layer (chance: 1/tasks). The projection colours prompts by task; on the shipped "
             "run the colours stay mixed in its two components although TD is well above chance.",
        try_first="Drag the training-step slider from 0 to about 2,000: TD after layer 1 "
                  "climbs from chance (0.25) to about 0.5 as the ICL loss falls; later steps "
                  "change little.",
        doc="docs/dynamics.md"),
    "circuits": Intro(
        shows="The edges between heads and MLPs that carry a task (edge attribution "
              "patching), how faithful the circuit is, and how it changes under fine-tuning.",
        paper="Hanna et al. (2024), EAP-IG; Wang et al. (ICML 2025) for fine-tuning",
        title="Towards Understanding Fine-Tuning Mechanisms of LLMs via Circuit Analysis",
        read="Nodes sit layer by layer; an edge's width is the size of its score and its "
             "colour the sign. The faithfulness curve shows how much of the model's "
             "behaviour a circuit of that many edges recovers.",
        try_first="Press 'Compute circuit', then move the top-n edges slider.",
        doc="docs/circuits.md"),
    "shattering": Intro(
        shows="A transformer trained on cyclic facts, one fact edited (ROME, MEMIT or "
              "fine-tuning), and how far the entity representations move.",
        paper="Nishi, Ramesh, Okawa, Khona, Tanaka & Lubana (ICML 2025)",
        title="Representation Shattering in Transformers: A Synthetic Study with Knowledge "
              "Editing",
        read="Grey lines join the unedited entities in cycle order (the paper finds them on "
             "rings; on the shipped model, which infers only 21 % of held-out facts, PCA shows "
             "no clear ring). An edit that moves the entities far from where they were raises "
             "the shattering ratio R, and the scatter below shows R against the accuracy lost "
             "on other facts.",
        try_first="Move the edit strength slider from 0 to 1.",
        doc="docs/editing.md"),
    "unlearning": Intro(
        shows="Where a fact is looked up in the model, and whether unlearning it at those "
              "layers holds against relearning.",
        paper="Guo, Syed, Sheshadri, Ewart & Dziugaite (ICML 2025)",
        title="Mechanistic Unlearning: Robust Knowledge Unlearning and Editing via "
              "Mechanistic Localization",
        read="The probe curve shows where the attribute can be read from the subject token; "
             "the shaded layers are the ones unlearning will train.",
        try_first="Press 'Localize', then 'Run unlearning' and compare forget and retain "
                  "accuracy.",
        doc="docs/unlearning.md"),
    "attention": Intro(
        shows="Every head's attention pattern on the sidebar prompt, all layers at once from "
              "one trace, and one head enlarged with its tokens.",
        paper="Olsson et al. (2022), induction and previous-token heads",
        title="In-context Learning and Induction Heads",
        read="Each small square is one head (layers down, heads across): row = query token, "
             "column = key token, darker = more attention. A bright left column is a head "
             "resting on the first token; a line just below the diagonal is a "
             "previous-token head.",
        try_first="Click a square to enlarge it, then type a prompt that repeats a phrase "
                  "and look for heads attending to the token after its first copy.",
        doc="README.md"),
    "atlas": Intro(
        shows="Every per-head score this session has computed, from every method, in one "
              "layer x head atlas: attention statistics of the sidebar prompt, induction, "
              "function-vector, context / memory scores and circuit edge mass per head.",
        paper="the scores of Olsson et al. (2022), Todd et al. (ICLR 2024), Li et al. (ICML 2025) "
              "and Hanna et al. (COLM 2024)",
        title="Function Vectors in Large Language Models",
        read="Pick a score: the heatmap shows it per head (layers down, heads across); the "
             "table has every score of every head, sortable and filterable; outlined cells "
             "and ticked rows are the heads selected in the sidebar.",
        try_first="Press Add induction scores, sort the table by induction_score and click "
                  "the top head: it is selected on every page (open Attention to see it).",
        doc="docs/workspace.md"),
    "dla": Intro(
        shows="Which heads and MLPs write the model's answer against an alternative on the "
              "sidebar prompt: each one's direct contribution to the logit difference, clean "
              "and under the workspace's edits.",
        paper="Elhage et al. (2021), direct logit attribution",
        title="A Mathematical Framework for Transformer Circuits",
        read="Rows are layers, columns the heads and the layer's MLP; red writes the answer, "
             "blue the alternative (logits, through the final norm of the clean run).",
        try_first="Click the reddest cell to select it, ablate it from the sidebar's menu and "
                  "read the edited and difference panels.",
        doc="docs/dla.md"),
    "compare": Intro(
        shows="Your prompt (A) and the sidebar's second prompt (B) side by side: the logit "
              "lens, the selected head's attention, the saturation layers or the logit "
              "attribution of each, aligned by position, and B − A.",
        paper="Wang et al. (ICLR 2023), prompts that differ in one name",
        title="Interpretability in the Wild: a Circuit for Indirect Object Identification "
              "in GPT-2 small",
        read="Top: A; below or beside it: B on the same axes and colours; then B − A on the "
             "diverging map (red: larger in B). Prompts of different lengths get no "
             "difference, and a note says why.",
        try_first="Open Second prompt (compare) in the sidebar, press Start from the prompt, "
                  "change one name and press Enter; then switch the view to Logit "
                  "attribution.",
        doc="docs/compare.md"),
    "features": Intro(
        shows="A dictionary's features as dashboards: where each fires in the shipped corpus, "
              "how strongly, on the sidebar prompt, and which tokens its decoder direction "
              "promotes; ITDA atoms or the TopK SAE baseline.",
        paper="Leask et al. (ICML 2025), ITDA; dashboards after Bricken et al. (2023)",
        title="Inference-Time Decomposition of Activations (ITDA)",
        read="Top contexts: the activating token outlined, every token shaded by the "
             "feature's activation (orange positive, blue negative); beside them the "
             "activation histogram and the logit effect W_U·d (red promoted, blue suppressed).",
        try_first="Type a word in Find features (e.g. bread), open the first feature, then "
                  "Steer with this feature and look at the Logit lens.",
        doc="docs/features.md"),
    "patching": Intro(
        shows="Which activations carry the difference between the sidebar prompt and a "
              "counterfactual of it: each cell copies one activation from one run into the "
              "other and shows how much of the answer moves with it.",
        paper="Meng et al. (NeurIPS 2022); Heimersheim & Nanda (2024)",
        title="How to use and interpret activation patching",
        read="Rows are layers, columns positions (or heads); red restores the clean answer "
             "(1 = the clean run's logit difference), 0 is the corrupted run's.",
        try_first="Click a name in the prompt, type the other name as its replacement, and "
                  "click the reddest late cell to select it.",
        doc="docs/patching.md"),
    "study": Intro(
        shows="A user study of another page's explanation: the Logit lens or the Logit "
              "attribution shown to participants, against no explanation and a placebo of the "
              "same form, served from this server, with its analysis as answers arrive.",
        paper="Pičulin et al. (ICML 2025), baselines and placebos in user studies",
        title="Position: Explainable AI Cannot Advance Without Better User Studies",
        read="The plot: accuracy per condition with its 95 % bootstrap interval over "
             "participants, chance dashed; the tables: each hypothesis's difference, "
             "permutation p and Holm-adjusted p.",
        try_first="Press Build study, then Open to participants, open the link in another "
                  "tab and answer a few questions: the analysis counts them.",
        doc="docs/studies.md"),
}


def intro_pane(slug: str) -> pn.pane.Markdown:
    """The intro block for page ``slug`` (KeyError for an unknown slug)."""
    i = INTROS[slug]
    doc = f" More: `{i.doc}`." if i.doc else ""
    text = (f"{i.shows} From [{i.paper}]({paper_url(i.title)}).\n\n"
            f"**How to read it:** {i.read} **Try first:** {i.try_first}{doc}")
    return pn.pane.Markdown(text, css_classes=["page-intro"], sizing_mode="stretch_width",
                            margin=(0, 10, 6, 10))
