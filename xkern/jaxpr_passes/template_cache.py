"""Traced pattern templates on disk, so that only the first process pays for tracing them.

Tracing the templates is most of a process's start-up (a training step's first plan traced ~1000 of
them in 7.6 of its 9 s on a 2-core CPU). A registry built by `patterns.build_registry` is stored
here as a pickle of its templates (their primitives by module and name, their source locations
dropped), in $XKERN_CACHE_DIR or ~/.cache/xkern, then patterns/<fingerprint>/<names>.pkl, beside
the tuned configs. The fingerprint covers everything a trace depends on: xkern's sources, the
versions of Python, jax, jaxlib, numpy, flax and optax (patterns trace flax's and optax's own
functions), and the jax config that changes traces (x64, dtype promotion); the file name covers
the patterns' names. A file that does not load is traced again and rewritten.

A stale template cannot make a wrong rewrite: templates only propose matches, and each one is
re-traced from the pattern's own function at the program's shapes and compared with the program
exactly before anything is replaced (patterns.py). The cache is as trusted as the generated kernel
sources beside it: both are code this user's processes wrote and will run.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import os
import pickle
import shutil
import sys
import tempfile
import time

import jax
from jax._src import core, source_info_util

FORMAT = 1  # bump when what is stored changes shape
_PRUNE_AFTER_S = 30 * 24 * 3600  # folders of other fingerprints unused this long are removed


@functools.cache
def fingerprint() -> str:
    """A hash of what traces depend on and does not change within a process."""
    digest = hashlib.sha256(f"{FORMAT}|{sys.version}".encode())
    for dist in ("jax", "jaxlib", "numpy", "flax", "optax"):
        try:
            digest.update(f"|{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"|{dist}=none".encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the xkern package
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:20]


def path_for(patterns) -> str:
    """The file of a registry of these patterns, traced under the current jax config."""
    from xkern.fusion.codegen import cache_dir  # the same root as generated sources and configs
    config = (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion)
    names = hashlib.sha256(repr((config, sorted(p.name for p in patterns))).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(os.path.join("patterns", fingerprint())), f"{names}.pkl")


def load(patterns) -> tuple[dict, list, list] | None:
    """(by_anchor, rejected, constants) as stored for these patterns, with by_anchor's patterns
    these objects; None if there is no usable file. constants: (anchor, index, values) of the
    templates that have some."""
    try:
        path = path_for(patterns)
        with open(path, "rb") as f:
            stored = _Unpickler(f).load()
        by_name = {p.name: p for p in patterns}
        by_anchor = {anchor: [(by_name[name], template) for name, template in entries]
                     for anchor, entries in stored["by_anchor"].items()}
        return by_anchor, stored["rejected"], stored["constants"]
    except FileNotFoundError:
        return None
    except Exception:  # a file from a crash, another format, a primitive jax no longer has: retrace
        return None


def store(patterns, by_anchor: dict, rejected: list, constants: list) -> None:
    """Write a built registry for later processes; where it cannot be written, they trace again."""
    try:
        path = path_for(patterns)
        stored = {"by_anchor": {anchor: [(p.name, t) for p, t in entries] for anchor, entries in by_anchor.items()},
                  "rejected": rejected, "constants": constants}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(stored)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        _prune(os.path.dirname(os.path.dirname(path)), keep=fingerprint())
    except (OSError, pickle.PicklingError, TypeError, AttributeError, KeyError):
        pass


def _prune(root: str, keep: str) -> None:
    """Remove the folders of other fingerprints (older xkern or jax) unused for a month."""
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        if name != keep and os.path.isdir(folder) and time.time() - os.path.getmtime(folder) > _PRUNE_AFTER_S:
            shutil.rmtree(folder, ignore_errors=True)


@functools.cache
def _primitive_names() -> dict:
    """id(primitive) -> (module, attribute) for every primitive a loaded jax module defines."""
    names = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("jax"):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, core.Primitive):
                names.setdefault(id(value), (module_name, attribute))
    return names


class _Pickler(pickle.Pickler):
    """Primitives by reference (matching compares them by identity and name), and no source
    locations (tracebacks do not pickle, and templates are never reported by location)."""

    def persistent_id(self, obj):
        if isinstance(obj, core.Primitive):
            if id(obj) not in _primitive_names():
                _primitive_names.cache_clear()  # defined by a module loaded since
            return ("primitive", *_primitive_names()[id(obj)])
        if isinstance(obj, source_info_util.SourceInfo):
            return ("source_info",)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self._resolved = {("source_info",): source_info_util.new_source_info()}  # (immutable: shared)

    def persistent_load(self, pid):
        if pid not in self._resolved:
            if pid[0] != "primitive":
                raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
            self._resolved[pid] = getattr(importlib.import_module(pid[1]), pid[2])
        return self._resolved[pid]
