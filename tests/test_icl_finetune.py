"""Early- vs late-layer LoRA (Han et al. 2025) on the tiny model: what is trained, what changes."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from explorer._checks import InputError
from explorer.analyses import icl_finetune as ft
from explorer.analyses import icl_heads as ih
from explorer.analyses import task_vectors as tv


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.hf.state_dict().items()}


def test_split_task_halves_are_disjoint_and_cover_the_task():
    task = ih.load_icl_task("antonym")
    train, held = ft.split_task(task, seed=3)
    assert train.name == held.name == "antonym"
    assert set(train.pairs).isdisjoint(held.pairs)
    assert sorted(train.pairs + held.pairs) == sorted(task.pairs)
    assert ft.split_task(task, seed=3) == (train, held)
    with pytest.raises(InputError, match="needs at least 10"):
        ft.split_task(ih.ICLTask("small", (("a", "b"),) * 4))


def test_lora_on_one_layer_trains_and_changes_only_that_layer(tiny_model):
    m = tiny_model
    before = _snapshot(m)
    train, held = ft.split_task("uppercase")
    lora = ft.LayerLoRA([2], rank=4, steps=3, lr=1e-2, batch_size=3, n_shots=2).fit(m, train)
    # the shared model is untouched (weights and frozen flags)
    for k, v in m.hf.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(p.requires_grad for p in m.hf.parameters())
    # only LoRA matrices of layer 2 were trainable; their count is r * (in + out) per map
    assert lora.trainable_names_ and all(
        ".layers.2." in n and ("lora_A" in n or "lora_B" in n) for n in lora.trainable_names_)
    linears = [mod for mod in m.hf_layer(2).modules() if isinstance(mod, torch.nn.Linear)]
    assert len(linears) == 7                       # q, k, v, o, gate, up, down
    assert lora.n_trainable_ == sum(4 * (l.in_features + l.out_features) for l in linears)
    assert len(lora.trainable_names_) == 2 * len(linears)
    # the merged copy differs from the original exactly in layer 2's linear weights
    after = lora.model_.hf.state_dict()
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(after[k], before[k])}
    expected = {f"model.layers.2.{n}.weight" for n in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert changed == expected
    assert lora.loss_.shape == (3,) and np.isfinite(lora.loss_).all()
    # the tuned copy runs through the explorer's own code path, with different outputs
    prompts, answers = ih.icl_prompts(held, n_prompts=3, n_shots=2)
    ids = torch.tensor([m.tokenizer(prompts[0], add_special_tokens=False)["input_ids"]])
    assert not torch.allclose(lora.model_.hf(ids).logits, m.hf(ids).logits)
    # its accuracy is what a plain forward of the tuned HF module gives, prompt by prompt
    hits = []
    for prompt, answer in zip(prompts, answers):
        ids_p = torch.tensor([m.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        first = m.tokenizer(" " + answer, add_special_tokens=False)["input_ids"][0]
        hits.append(int(lora.model_.hf(ids_p).logits[0, -1].argmax()) == first)
    assert ih.few_shot_accuracy(lora.model_, prompts, answers) == pytest.approx(np.mean(hits))
    with pytest.raises(InputError, match="`layers` must be a non-empty list"):
        ft.LayerLoRA([])
    with pytest.raises(InputError, match="`layer` must be an int in"):
        ft.LayerLoRA([5], steps=1).fit(m, train)


def test_early_late_finetune_tunes_the_lowest_td_task_with_equal_adapters(tiny_model):
    m = tiny_model
    tasks = ["antonym", "uppercase", "country-capital"]
    ds = ft.early_late_finetune(m, tasks, n_layers_tuned=1, steps=2, n_prompts=5, n_shots=2,
                                k=3, batch_size=2)
    assert list(ds.variant.values) == ["base", "early", "late"]
    assert ds.attrs["early_layers"] == [0] and ds.attrs["late_layers"] == [2]
    n = ds.n_trainable.values
    assert n[0] == 0 and n[1] == n[2] > 0
    # base TD and the chosen task, recomputed on the held-out halves
    held = [ft.split_task(t)[1] for t in tasks]
    base = tv.task_decodability(m, held, n_prompts=5, n_shots=2, k=3)
    np.testing.assert_allclose(ds.td.sel(variant="base").values, base.td.values)
    per_task = base.td_per_task.sel(task=tasks).mean("layer").values
    assert ds.attrs["task"] == tasks[int(np.argmin(per_task))]
    assert float(ds.accuracy.sel(variant="base")) == pytest.approx(
        float(base.icl_accuracy.sel(task=ds.attrs["task"])))
    assert np.isnan(ds.train_loss.sel(variant="base")).all()
    assert np.isfinite(ds.train_loss.sel(variant=["early", "late"])).all()
    summary = ft.finetune_summary(ds)
    assert set(summary) >= {"task", "base", "early", "late"}
    with pytest.raises(InputError, match="at least 2 tasks"):
        ft.early_late_finetune(m, ["antonym"])
    with pytest.raises(InputError, match="`n_layers_tuned` must be an int in"):
        ft.early_late_finetune(m, tasks, n_layers_tuned=2)


def test_cli_icl_finetune_json(capsys):
    from explorer.commands.icl_finetune import register_cli

    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["icl-finetune", "--model", "tiny-llama", "--tasks",
                              "antonym,uppercase", "--steps", "1", "--n-prompts", "4",
                              "--n-shots", "2", "--k", "3", "--batch-size", "2", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["early_layers"] == [0] and out["late_layers"] == [2]
    assert out["early"]["n_trainable"] == out["late"]["n_trainable"] > 0
    assert len(out["base"]["td"]) == 3



def test_cli_icl_finetune_runs_at_one_thread_unless_threads_says_otherwise(monkeypatch):
    """The command's own default is one torch thread; the CLI's global --threads overrides
    it (no flag of its own clashes with it) and main restores the count afterwards."""
    from explorer import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("explorer.commands.icl_finetune",))
    parser = cli.build_parser()
    args = parser.parse_args(["icl-finetune", "--model", "tiny-llama"])
    assert args.threads is None and args.default_threads == 1
    assert cli._threads(args) == 1
    args = parser.parse_args(["icl-finetune", "--threads", "3"])
    assert cli._threads(args) == 3
    args = parser.parse_args(["--threads", "2", "icl-finetune"])
    assert cli._threads(args) == 2
    seen = []

    def finetune(*args, **kwargs):  # record the thread count the run gets, then stop it
        seen.append(torch.get_num_threads())
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(ft, "early_late_finetune", finetune)
    before = torch.get_num_threads()
    assert cli.main(["icl-finetune", "--model", "tiny-llama", "--tasks", "antonym,uppercase"]) == 1
    assert cli.main(["icl-finetune", "--model", "tiny-llama", "--threads", "2"]) == 1
    assert seen == [1, 2] and torch.get_num_threads() == before

def test_hooks_engine_trains_the_same_maps_and_td_sees_the_adapters(tiny_model):
    """LayerLoRA(engine="hooks") trains the same maps as peft without copying the model,
    and leaves it untouched. task_decodability(lora=...) with zero adapters gives the plain
    numbers exactly; with trained adapters it gives what the merged peft copy gives."""
    m = tiny_model
    before = _snapshot(m)
    train, held = ft.split_task("uppercase")
    kw = dict(rank=4, steps=3, lr=5e-2, batch_size=3, n_shots=2, seed=1)
    hooks = ft.LayerLoRA([0, 2], engine="hooks", **kw).fit(m, train)
    peft = ft.LayerLoRA([0, 2], **kw).fit(m, train)
    for k, v in m.hf.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in m.hf.parameters())
    assert hooks.model_ is None and peft.model_ is not None
    assert hooks.trainable_names_ == peft.trainable_names_
    assert hooks.n_trainable_ == peft.n_trainable_ == hooks.lora_.n_params()
    assert sorted(hooks.lora_.names()) == sorted(peft.lora_.names()) == sorted(peft.target_modules_)
    # both start with B = 0, so the first step's loss is the base model's on the same prompts
    assert hooks.loss_[0] == pytest.approx(peft.loss_[0], rel=1e-5)
    assert np.isfinite(hooks.loss_).all() and hooks.loss_[1] != pytest.approx(peft.loss_[1])
    assert all(float(b.abs().max()) > 0 for b in hooks.lora_.B.values())  # B was trained

    tasks = [held, ft.split_task("antonym")[1]]
    opts = dict(n_prompts=5, n_shots=2, k=3)
    plain = tv.task_decodability(m, tasks, **opts)
    zero = peft.lora_.trainable()
    zero = type(zero)({k: v.detach() for k, v in zero.A.items()},
                      {k: torch.zeros_like(v) for k, v in zero.B.items()}, zero.scaling)
    same = tv.task_decodability(m, tasks, lora=zero, **opts)
    for name in ("td", "td_per_task", "icl_accuracy", "projection"):
        np.testing.assert_array_equal(same[name].values, plain[name].values, err_msg=name)
    by_hooks = tv.task_decodability(m, tasks, lora=peft.lora_, **opts)
    merged = tv.task_decodability(peft.model_, tasks, **opts)
    np.testing.assert_allclose(by_hooks.projection.values, merged.projection.values,
                               rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(by_hooks.td.values, merged.td.values)
    np.testing.assert_array_equal(by_hooks.icl_accuracy.values, merged.icl_accuracy.values)
    assert not np.allclose(by_hooks.projection.values, plain.projection.values, atol=1e-3)
    with pytest.raises(InputError, match="takes no `store`"):
        tv.task_decodability(m, tasks, lora=peft.lora_, store=object(), **opts)
    with pytest.raises(InputError, match="`engine` must be one of"):
        ft.LayerLoRA([0], engine="copy")
