"""The response store: one SQLite file per study run (stdlib ``sqlite3``, WAL mode).

Each response is committed in its own transaction the moment it is submitted, with
``synchronous=FULL``, so a crashed server, a killed process or a closed browser tab loses
nothing already answered. A response's key is (participant code, trial index): a retried
submission of the same answer is recognised and not stored twice, and the first committed
answer to a trial is the one that counts. A participant resumes with their code at the
first trial they have not answered.

The store also holds the schedule (which item, under which condition, at which place, for
each participant slot) and the answer key, so correctness is decided here, never by the
browser. Nothing personal is stored: a participant is a random code.
"""
from __future__ import annotations

import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from explorer._checks import InputError, StoreError, check_int

from .randomise import Trial

__all__ = ["ResponseStore", "Participant", "Recorded", "new_participant_code", "CODE_PATTERN"]

_SCHEMA_VERSION = "1"
_CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"   # no 0/O, 1/I/L: read aloud and typed safely
CODE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{3,63}$")

_TABLES = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS items (
    item_id TEXT PRIMARY KEY,
    answer INTEGER NOT NULL,
    n_choices INTEGER NOT NULL,
    attention_check INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS schedule (
    slot INTEGER NOT NULL,
    trial_index INTEGER NOT NULL,
    item_id TEXT NOT NULL REFERENCES items(item_id),
    condition TEXT NOT NULL,
    PRIMARY KEY (slot, trial_index)
);
CREATE TABLE IF NOT EXISTS participants (
    code TEXT PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE,
    consented_at REAL NOT NULL,
    finished_at REAL,
    simulated INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS responses (
    code TEXT NOT NULL REFERENCES participants(code),
    trial_index INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    condition TEXT NOT NULL,
    choice INTEGER NOT NULL,
    correct INTEGER NOT NULL,
    confidence INTEGER NOT NULL,
    shown_at REAL NOT NULL,
    answered_at REAL NOT NULL,
    rt_ms REAL NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (code, trial_index)
);
"""


def new_participant_code() -> str:
    """A random participant code like ``K7QX-M2PA`` (31^8, about 10^12 possibilities)."""
    raw = "".join(secrets.choice(_CODE_ALPHABET) for _ in range(8))
    return f"{raw[:4]}-{raw[4:]}"


@dataclass(frozen=True)
class Participant:
    """An enrolled participant: their code and schedule slot."""

    code: str
    slot: int
    consented_at: float
    finished_at: float | None
    simulated: bool


@dataclass(frozen=True)
class Recorded:
    """The outcome of `ResponseStore.record_response`.

    ``created`` is False when the trial had been answered already (a retry): ``row`` is
    then the answer stored first, which is the one that counts.
    """

    row: dict[str, Any]
    created: bool
    finished: bool


class ResponseStore:
    """Responses, schedule and answer key of one study run in an SQLite file.

    Parameters
    ----------
    path : str or Path
        The database file; it must have been made by `ResponseStore.create`.
    timeout : float, default=30.0
        Seconds to wait for another writer (another session, process) before giving up.
    """

    def __init__(self, path: str | Path, *, timeout: float = 30.0):
        self.path = Path(path)
        if not self.path.exists():
            raise StoreError(f"no response database at {str(self.path)!r}; prepare the study "
                             "run first ('explorer study run STUDY --dir FOLDER').")
        self._lock = threading.Lock()
        self._conn = _connect(self.path, timeout)
        if self.meta().get("schema_version") != _SCHEMA_VERSION:
            self.close()
            raise StoreError(f"{str(self.path)!r} is not a study response database of this "
                             f"version (schema {_SCHEMA_VERSION}).")

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, *, schedule: Sequence[Sequence[Trial]],
               items: Iterable[dict[str, Any]], meta: dict[str, Any],
               timeout: float = 30.0) -> ResponseStore:
        """Create the database with its schedule, answer key and metadata, in one transaction.

        Parameters
        ----------
        path : str or Path
            A file that does not exist yet.
        schedule : sequence of sequence of Trial
            Per slot, the trials in order (`explorer.studies.randomise.study_schedule`).
        items : iterable of dict
            With ``id``, ``answer``, ``choices``, ``attention_check``.
        meta : dict
            JSON-able values stored under their keys (study name, hash, seeds...).
        """
        path = Path(path)
        if path.exists():
            raise StoreError(f"{str(path)!r} exists already; a response database is never "
                             "overwritten.")
        conn = _connect(path, timeout)
        try:
            conn.executescript(_TABLES)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT INTO items VALUES (?, ?, ?, ?)",
                             [(it["id"], int(it["answer"]), len(it["choices"]),
                               int(bool(it.get("attention_check")))) for it in items])
            conn.executemany("INSERT INTO schedule VALUES (?, ?, ?, ?)",
                             [(slot, t.index, t.item_id, t.condition)
                              for slot, trials in enumerate(schedule) for t in trials])
            values = {**{k: json.dumps(v) for k, v in meta.items()},
                      "schema_version": _SCHEMA_VERSION, "n_slots": str(len(schedule))}
            conn.executemany("INSERT INTO meta VALUES (?, ?)", sorted(values.items()))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()
        return cls(path, timeout=timeout)

    def close(self) -> None:
        """Close the connection (committed responses are already on disk)."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> ResponseStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- reading ----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """The metadata stored at creation (``schema_version`` and ``n_slots`` as strings)."""
        with self._lock:
            rows = self._conn.execute("SELECT key, value FROM meta").fetchall()
        out: dict[str, Any] = {}
        for key, value in rows:
            try:
                out[key] = json.loads(value) if key not in ("schema_version", "n_slots") else value
            except json.JSONDecodeError:
                out[key] = value
        return out

    @property
    def n_slots(self) -> int:
        return int(self.meta()["n_slots"])

    def participant(self, code: str) -> Participant:
        """The participant with ``code``; InputError if there is none."""
        code = _check_code(code)
        with self._lock:
            row = self._conn.execute("SELECT code, slot, consented_at, finished_at, simulated "
                                     "FROM participants WHERE code = ?", (code,)).fetchone()
        if row is None:
            raise InputError(f"no participant with code {code!r} in this study; check the code "
                             "(letters and digits as shown when you started).")
        return Participant(row[0], row[1], row[2], row[3], bool(row[4]))

    def participants(self) -> list[Participant]:
        """Every enrolled participant, by slot."""
        with self._lock:
            rows = self._conn.execute("SELECT code, slot, consented_at, finished_at, simulated "
                                      "FROM participants ORDER BY slot").fetchall()
        return [Participant(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows]

    def trials(self, code: str) -> list[Trial]:
        """The participant's trials, in the order they are shown."""
        slot = self.participant(code).slot
        with self._lock:
            rows = self._conn.execute("SELECT trial_index, item_id, condition FROM schedule "
                                      "WHERE slot = ? ORDER BY trial_index", (slot,)).fetchall()
        return [Trial(index=r[0], item_id=r[1], condition=r[2]) for r in rows]

    def answered(self, code: str) -> dict[int, dict[str, Any]]:
        """The participant's stored responses by trial index."""
        rows = self._select("WHERE r.code = ?", (_check_code(code),))
        return {r["trial_index"]: r for r in rows}

    def next_trial(self, code: str) -> Trial | None:
        """The first trial the participant has not answered; None when they are done."""
        done = self.answered(code)
        return next((t for t in self.trials(code) if t.index not in done), None)

    def responses(self) -> list[dict[str, Any]]:
        """Every stored response (with the participant's slot and simulated flag), in order."""
        return self._select("", ())

    def _select(self, where: str, params: tuple) -> list[dict[str, Any]]:
        sql = ("SELECT r.code, p.slot, r.trial_index, r.item_id, r.condition, r.choice, "
               "r.correct, r.confidence, r.shown_at, r.answered_at, r.rt_ms, r.recorded_at, "
               "p.simulated, i.attention_check FROM responses r "
               "JOIN participants p ON p.code = r.code JOIN items i ON i.item_id = r.item_id "
               f"{where} ORDER BY p.slot, r.trial_index")
        with self._lock:
            cur = self._conn.execute(sql, params)
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, r)) for r in cur.fetchall()]
        for r in rows:
            r["simulated"] = bool(r["simulated"])
            r["attention_check"] = bool(r["attention_check"])
        return rows

    # -- writing ----------------------------------------------------------------------
    def enrol(self, code: str | None = None, *, simulated: bool = False,
              now: float | None = None) -> Participant:
        """Give a consenting participant the next free slot (one transaction).

        Parameters
        ----------
        code : str, optional
            Their code; default a new random one (`new_participant_code`).
        simulated : bool, default=False
            Marks a simulated participant (reports say so).

        Raises
        ------
        InputError
            The code is taken or malformed, or every slot is filled.
        """
        code = new_participant_code() if code is None else _check_code(code)
        now = time.time() if now is None else float(now)
        with self._lock, _transaction(self._conn):
            taken = self._conn.execute("SELECT 1 FROM participants WHERE code = ?", (code,)).fetchone()
            if taken:
                raise InputError(f"participant code {code!r} is taken; resume with it instead "
                                 "of starting again.")
            row = self._conn.execute(
                "SELECT MIN(slot) FROM (SELECT DISTINCT slot FROM schedule) "
                "WHERE slot NOT IN (SELECT slot FROM participants)").fetchone()
            if row[0] is None:
                raise InputError(f"the study is full: all {self._n_slots_locked()} participant "
                                 "places are taken.")
            slot = int(row[0])
            self._conn.execute("INSERT INTO participants (code, slot, consented_at, simulated) "
                               "VALUES (?, ?, ?, ?)", (code, slot, now, int(simulated)))
        return Participant(code, slot, now, None, simulated)

    def _n_slots_locked(self) -> int:
        return int(self._conn.execute("SELECT value FROM meta WHERE key = 'n_slots'").fetchone()[0])

    def record_response(self, code: str, trial_index: int, *, choice: int, confidence: int,
                        shown_at: float, answered_at: float | None = None,
                        confidence_levels: int = 10) -> Recorded:
        """Store one answer in its own transaction; a repeat of the same key stores nothing.

        Parameters
        ----------
        code : str
            The participant.
        trial_index : int
            Place of the trial in their sequence (0-based).
        choice : int
            Index of the chosen option.
        confidence : int
            1 (guess) .. ``confidence_levels`` (certain).
        shown_at, answered_at : float
            Unix times the item was shown and answered (default now).

        Returns
        -------
        Recorded
            The stored row, whether it was new, and whether the participant is now done.
        """
        code = _check_code(code)
        trial_index = check_int("trial_index", trial_index)
        choice = check_int("choice", choice, low=0)
        confidence = check_int("confidence", confidence, low=1, high=confidence_levels)
        answered_at = time.time() if answered_at is None else float(answered_at)
        shown_at = float(shown_at)
        with self._lock, _transaction(self._conn):
            part = self._conn.execute("SELECT slot FROM participants WHERE code = ?", (code,)).fetchone()
            if part is None:
                raise InputError(f"no participant with code {code!r} in this study.")
            trial = self._conn.execute(
                "SELECT s.item_id, s.condition, i.answer, i.n_choices FROM schedule s "
                "JOIN items i ON i.item_id = s.item_id WHERE s.slot = ? AND s.trial_index = ?",
                (part[0], trial_index)).fetchone()
            if trial is None:
                n = self._conn.execute("SELECT COUNT(*) FROM schedule WHERE slot = ?",
                                       (part[0],)).fetchone()[0]
                raise InputError(f"`trial_index` must be an int in [0, {n - 1}]; got {trial_index}.")
            item_id, condition, answer, n_choices = trial
            if choice >= n_choices:
                raise InputError(f"`choice` must be an int in [0, {n_choices - 1}]; got {choice}.")
            cur = self._conn.execute(
                "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (code, trial_index) DO NOTHING",
                (code, trial_index, item_id, condition, choice, int(choice == answer), confidence,
                 shown_at, answered_at, max(0.0, (answered_at - shown_at) * 1000.0), time.time()))
            created = cur.rowcount == 1
            left = self._conn.execute(
                "SELECT COUNT(*) FROM schedule WHERE slot = ? AND trial_index NOT IN "
                "(SELECT trial_index FROM responses WHERE code = ?)", (part[0], code)).fetchone()[0]
            if left == 0:
                self._conn.execute("UPDATE participants SET finished_at = COALESCE(finished_at, ?) "
                                   "WHERE code = ?", (answered_at, code))
        row = self.answered(code)[trial_index]
        return Recorded(row=row, created=created, finished=left == 0)


def _connect(path: Path, timeout: float) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # autocommit mode: transactions are opened and closed explicitly (`_transaction`)
        conn = sqlite3.connect(str(path), timeout=timeout, isolation_level=None,
                               check_same_thread=False)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            conn.close()
            raise StoreError(f"{str(path)!r}: SQLite could not switch to WAL mode (got {mode!r}); "
                             "use a local file system.")
        conn.execute("PRAGMA synchronous=FULL")   # a commit is on disk before it returns
        conn.execute("PRAGMA foreign_keys=ON")
        return conn
    except sqlite3.DatabaseError as err:
        raise StoreError(f"cannot open the response database {str(path)!r} ({err}).") from None


class _transaction:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` (``ROLLBACK`` on any error): one write at a time."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as err:   # another writer held the lock past the timeout
            raise StoreError(f"the response database is busy ({err}); try again.") from None
        return self.conn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.conn.execute("COMMIT")
            except sqlite3.OperationalError as err:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise StoreError(f"the answer could not be saved ({err}); try again.") from None
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")


def _check_code(code: Any) -> str:
    if not isinstance(code, str):
        raise TypeError(f"`code` must be a string; got {type(code).__name__}.")
    code = code.strip().upper() if re.fullmatch(r"[A-Za-z0-9]{4}-[A-Za-z0-9]{4}", code.strip()) \
        else code.strip()
    if not CODE_PATTERN.match(code):
        raise InputError(f"`code` must be 4 to 64 letters, digits, '-' or '_'; got {code!r}.")
    return code
