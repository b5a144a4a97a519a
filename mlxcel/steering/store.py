"""Profiles, clusters and circuits persisted in SQLite under the server's state directory.

A profile is a named set of steering values {feature: strength} for one SAE (by id) at one
layer. A cluster is a profile imported from a miStudio cluster document: it keeps the raw
document bytes (exported back byte for byte), its declared intensity_range and a persistent
intensity dial. A circuit (circuits.py) keeps its raw document, the name it is served under
and its persistent dial; everything else is re-derived from the document. One row, profile or
circuit, is active at a time. Schema changes are numbered migrations applied in order at open, so a state
directory written by an older mlxcel opens under a newer one.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DB_FILE = "steering.sqlite3"

MIGRATIONS: tuple[str, ...] = (
    """CREATE TABLE profiles (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE,
        description TEXT NOT NULL DEFAULT '',
        model TEXT,
        sae_id TEXT,
        layer INTEGER,
        steering TEXT NOT NULL,
        kind TEXT NOT NULL DEFAULT 'profile',
        active INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        updated REAL NOT NULL)""",
    """ALTER TABLE profiles ADD COLUMN intensity REAL NOT NULL DEFAULT 1.0;
       ALTER TABLE profiles ADD COLUMN intensity_min REAL;
       ALTER TABLE profiles ADD COLUMN intensity_max REAL;
       ALTER TABLE profiles ADD COLUMN document BLOB""",
    """CREATE TABLE circuits (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        document BLOB NOT NULL,
        intensity REAL NOT NULL DEFAULT 1.0,
        active INTEGER NOT NULL DEFAULT 0,
        model TEXT,
        created REAL NOT NULL,
        updated REAL NOT NULL)""",
)


@dataclass
class Profile:
    name: str
    steering: dict[int, float]
    sae_id: str | None = None
    layer: int | None = None
    model: str | None = None
    description: str = ""
    kind: str = "profile"  # "profile" | "cluster"
    active: bool = False
    intensity: float = 1.0  # a cluster's persistent dial
    intensity_min: float | None = None  # a cluster's declared intensity_range
    intensity_max: float | None = None
    document: bytes | None = field(default=None, repr=False)  # a cluster's raw import
    id: int | None = None
    created: float = 0.0
    updated: float = 0.0

    def public(self) -> dict:
        out = {"id": self.id, "name": self.name, "description": self.description, "model": self.model,
               "sae_id": self.sae_id, "layer": self.layer, "kind": self.kind, "active": self.active,
               "steering": {str(k): v for k, v in sorted(self.steering.items())},
               "created": self.created, "updated": self.updated}
        if self.kind == "cluster":
            out["intensity"] = self.intensity
            out["intensity_range"] = (None if self.intensity_min is None
                                      else [self.intensity_min, self.intensity_max])
        return out


_COLUMNS = ("id", "name", "description", "model", "sae_id", "layer", "steering", "kind", "active", "created",
            "updated", "intensity", "intensity_min", "intensity_max", "document")


class ProfileExists(ValueError):
    pass


@dataclass
class CircuitRow:
    id: str
    name: str
    document: bytes = field(repr=False)
    intensity: float = 1.0  # the persistent dial
    active: bool = False
    model: str | None = None
    created: float = 0.0
    updated: float = 0.0


_CIRCUIT_COLUMNS = ("id", "name", "document", "intensity", "active", "model", "created", "updated")


class SteeringStore:
    """One SQLite file; every call is a short transaction under one lock."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / DB_FILE
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            for i, script in enumerate(MIGRATIONS[version:], start=version + 1):
                self._db.executescript(f"BEGIN; {script}; PRAGMA user_version = {i}; COMMIT;")

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def _row(r: tuple) -> Profile:
        d = dict(zip(_COLUMNS, r))
        d["steering"] = {int(k): float(v) for k, v in json.loads(d["steering"]).items()}
        d["active"] = bool(d["active"])
        d["document"] = None if d["document"] is None else bytes(d["document"])
        return Profile(**d)

    def list(self, kind: str | None = None) -> list[Profile]:
        q = f"SELECT {', '.join(_COLUMNS)} FROM profiles"
        args: tuple = ()
        if kind:
            q, args = q + " WHERE kind = ?", (kind,)
        with self._lock:
            return [self._row(r) for r in self._db.execute(q + " ORDER BY id", args)]

    def get(self, name: str) -> Profile | None:
        with self._lock:
            r = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM profiles WHERE name = ?", (name,)).fetchone()
        return None if r is None else self._row(r)

    def active(self) -> Profile | None:
        with self._lock:
            r = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM profiles WHERE active = 1").fetchone()
        return None if r is None else self._row(r)

    def create(self, p: Profile) -> Profile:
        now = time.time()
        try:
            with self._lock:
                cur = self._db.execute(
                    "INSERT INTO profiles (name, description, model, sae_id, layer, steering, kind, active, created,"
                    " updated, intensity, intensity_min, intensity_max, document)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
                    (p.name, p.description, p.model, p.sae_id, p.layer, _values_json(p.steering), p.kind, now, now,
                     p.intensity, p.intensity_min, p.intensity_max, p.document))
        except sqlite3.IntegrityError:
            raise ProfileExists(f"a profile named {p.name!r} exists") from None
        p.id, p.created, p.updated, p.active = cur.lastrowid, now, now, False
        return p

    def update(self, name: str, **changes) -> Profile | None:
        allowed = {"description", "model", "sae_id", "layer", "steering", "intensity", "name"}
        sets, args = [], []
        for k, v in changes.items():
            if k not in allowed:
                raise ValueError(f"unknown profile field {k!r}")
            sets.append(f"{k} = ?")
            args.append(_values_json(v) if k == "steering" else v)
        if sets:
            try:
                with self._lock:
                    self._db.execute(f"UPDATE profiles SET {', '.join(sets)}, updated = ? WHERE name = ?",
                                     (*args, time.time(), name))
            except sqlite3.IntegrityError:
                raise ProfileExists(f"a profile named {changes.get('name')!r} exists") from None
        return self.get(changes.get("name", name))

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM profiles WHERE name = ?", (name,)).rowcount > 0

    def activate(self, name: str | None) -> Profile | None:
        """Make `name` the one active profile (None: deactivate all)."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("UPDATE profiles SET active = 0 WHERE active = 1")
            if name is not None:
                self._db.execute("UPDATE circuits SET active = 0 WHERE active = 1")
                self._db.execute("UPDATE profiles SET active = 1 WHERE name = ?", (name,))
            self._db.execute("COMMIT")
        return None if name is None else self.get(name)

    # -- circuits -------------------------------------------------------------------------
    @staticmethod
    def _circuit(r: tuple) -> CircuitRow:
        d = dict(zip(_CIRCUIT_COLUMNS, r))
        d["document"], d["active"] = bytes(d["document"]), bool(d["active"])
        return CircuitRow(**d)

    def circuits(self) -> list[CircuitRow]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_CIRCUIT_COLUMNS)} FROM circuits ORDER BY created, id")
            return [self._circuit(r) for r in rows]

    def circuit(self, ref: str) -> CircuitRow | None:
        """By id, else by name."""
        with self._lock:
            r = self._db.execute(f"SELECT {', '.join(_CIRCUIT_COLUMNS)} FROM circuits WHERE id = ? OR name = ? "
                                 "ORDER BY id = ? DESC", (ref, ref, ref)).fetchone()
        return None if r is None else self._circuit(r)

    def active_circuit(self) -> CircuitRow | None:
        with self._lock:
            r = self._db.execute(f"SELECT {', '.join(_CIRCUIT_COLUMNS)} FROM circuits WHERE active = 1").fetchone()
        return None if r is None else self._circuit(r)

    def create_circuit(self, name: str, document: bytes, intensity: float, model: str | None,
                       rename: bool = True) -> CircuitRow:
        """Insert under `name`, or `name (2)`, `name (3)`... when taken and `rename`."""
        now = time.time()
        for n in range(1, 1000):
            candidate = name if n == 1 else f"{name} ({n})"
            row = CircuitRow(id="circ_" + secrets.token_hex(8), name=candidate, document=document,
                             intensity=intensity, model=model, created=now, updated=now)
            try:
                with self._lock:
                    self._db.execute("INSERT INTO circuits (id, name, document, intensity, active, model, created,"
                                     " updated) VALUES (?, ?, ?, ?, 0, ?, ?, ?)",
                                     (row.id, row.name, document, intensity, model, now, now))
                return row
            except sqlite3.IntegrityError:
                if not rename:
                    raise ProfileExists(f"a circuit named {name!r} exists") from None
        raise ProfileExists(f"too many circuits named {name!r}")

    def set_circuit_intensity(self, circuit_id: str, intensity: float) -> CircuitRow | None:
        with self._lock:
            self._db.execute("UPDATE circuits SET intensity = ?, updated = ? WHERE id = ?",
                             (intensity, time.time(), circuit_id))
        return self.circuit(circuit_id)

    def delete_circuit(self, circuit_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM circuits WHERE id = ?", (circuit_id,)).rowcount > 0

    def activate_circuit(self, circuit_id: str | None) -> CircuitRow | None:
        """Make this circuit the one active row (deactivating any profile); None: no circuit."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("UPDATE circuits SET active = 0 WHERE active = 1")
            if circuit_id is not None:
                self._db.execute("UPDATE profiles SET active = 0 WHERE active = 1")
                self._db.execute("UPDATE circuits SET active = 1 WHERE id = ?", (circuit_id,))
            self._db.execute("COMMIT")
        return None if circuit_id is None else self.circuit(circuit_id)


def _values_json(values: dict[int, float]) -> str:
    return json.dumps({str(int(k)): float(v) for k, v in sorted(values.items())})
