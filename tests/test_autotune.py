"""The autotuner's choice and its on-disk config cache (shared by processes)."""
import json
import math
import subprocess
import sys

import pytest

from xkern.kernels import launch as L
from xkern.kernels.generated import matmul_configs
from xkern.tuning import autotune

A = L.Config.of(BLOCK_M=64, num_warps=4)
B = L.Config.of(BLOCK_M=128, num_warps=8, num_stages=3)
C = L.Config.of(BLOCK_M=256, num_warps=8)


@pytest.fixture(autouse=True)
def tuning_enabled(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "1")  # conftest turns it off for GPU test runs


def test_best_picks_the_fastest_and_skips_failures():
    times = {A: 3.0, B: 1.0}

    def measure(config):
        if config == C:
            raise RuntimeError("out of shared memory")
        return times[config]

    assert autotune.best([A, B, C], measure) == (B, 1.0)
    assert autotune.best([C], measure) == (C, math.inf)  # nothing ran: the heuristic, unstored


def test_a_candidate_whose_result_differs_is_never_the_winner():
    """Each family's measure checks a candidate's results against the first candidate's
    (autotune.agrees) before timing it: the fastest tile, miscompiled, loses to the slower right ones.
    Rounding-level differences pass; NaN only where the first has it; shapes must agree."""
    import numpy as np
    right = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    results = {A: right, B: right * 1.3, C: right + 1e-4}
    times = {A: 3.0, B: 1.0, C: 2.0}
    first = []

    def measure(config):
        autotune.agrees(first, {"out": results[config]})
        return times[config]
    assert autotune.best([A, B, C], measure) == (C, 2.0)
    import jax.numpy as jnp
    right16 = jnp.asarray(right, jnp.bfloat16)
    with pytest.raises(autotune.Disagrees, match="off by"):
        autotune.agrees([right16], np.where(np.eye(8, dtype=bool), np.nan, right))  # NaN where it has none
    autotune.agrees([right16], right + 0.05)  # within 2e-2 of the largest magnitude (3)
    nan_on_diagonal = np.where(np.eye(8, dtype=bool), np.nan, right)
    autotune.agrees([jnp.asarray(nan_on_diagonal, jnp.bfloat16)], nan_on_diagonal)  # NaN where the first has it
    with pytest.raises(autotune.Disagrees):
        autotune.agrees([right], right + 0.05)  # float32: 1e-3 of it
    lse = np.array([1.0, -np.inf, 2.0], np.float32)  # -inf: a row that sees no key, in both
    autotune.agrees([lse], lse)
    with pytest.raises(autotune.Disagrees):
        autotune.agrees([lse], np.array([1.0, 0.0, 2.0], np.float32))
    with pytest.raises(autotune.Disagrees, match="shape"):
        autotune.agrees([right], right[:4])


def test_a_candidate_skipped_for_its_results_is_reported_and_recorded(tmp_path):
    """A candidate whose results differ (a miscompile, most likely) is named in a warning when the key
    is tuned, with the reason, and kept in the cache entry; a later process reads the winner quietly."""
    import warnings
    import numpy as np
    path = str(tmp_path / "dev.json")
    right = np.arange(6, dtype=np.float32)
    results, times, first = {A: right, B: right * 2, C: right}, {A: 2e-3, B: 1e-3, C: 3e-3}, []

    def measure(config):
        autotune.agrees(first, results[config])
        return times[config]
    with pytest.warns(RuntimeWarning, match=r"attention_dkdv candidate \(BLOCK_M=128, num_warps=8, num_stages=3\)"
                                            r".* at 1x64 \(off by 5 .*\); skipped"):
        assert autotune.tuned("attention_dkdv", "1x64", [A, B, C], measure, "triton", path) == A
    (entry,) = json.load(open(path)).values()
    assert entry["disagreed"] == ["(BLOCK_M=128, num_warps=8, num_stages=3): off by 5 from the first candidate's "
                                  "result (allowed 0.005)"] and entry["meta"] == {"BLOCK_M": 64}
    autotune._MEMORY.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned("attention_dkdv", "1x64", [A, B, C], measure, "triton", path) == A
    # several differing from the first: the first itself is suspect, and the warning says so
    results, first[:] = {A: right * 2, B: right, C: right}, []
    with pytest.warns(RuntimeWarning) as seen:
        autotune.tuned("fam", "k", [A, B, C], measure, "triton", path)
    assert [str(w.message)[:26] for w in seen] == ["xkern: the fam candidate ("] * 2 + ["xkern: 2 fam candidates di"]
    assert "the first, (BLOCK_M=64, num_warps=4, num_stages=" in str(seen[2].message)
    # a key whose candidates all agree stores no such list
    assert "disagreed" not in json.load(open(path)).get("mm|1", {}) and autotune.tuned(
        "mm", "1", [A, C], lambda c: times[c], "triton", path) == A
    assert "disagreed" not in json.load(open(path))["mm|1"]


def test_best_keeps_each_finalists_faster_time():
    """A clock drift during the first pass (A measured slow once) is undone by the second."""
    seen = {A: [3.0, 1.0], B: [2.0, 2.0], C: [5.0, 5.0]}
    assert autotune.best([A, B, C], lambda config: seen[config].pop(0)) == (A, 1.0)


def test_tuned_measures_once_then_reads_the_file(tmp_path):
    path = str(tmp_path / "dev.json")
    calls = []

    def measure(config):
        calls.append(config)
        return {A: 2e-3, B: 1e-3, C: 5e-3}[config]

    assert autotune.tuned("mm", "8x8", [A, B, C], measure, "triton", path) == B
    assert calls == [A, B, C, C, A, B]  # each once, then the finalists again, fastest last
    assert autotune.tuned("mm", "8x8", [A, B, C], measure, "triton", path) == B
    assert len(calls) == 6  # from memory
    saved = json.load(open(path))
    assert saved["mm|8x8"]["us"] == 1000.0 and saved["mm|8x8"]["num_stages"] == 3
    autotune._MEMORY.clear()
    assert autotune.lookup("mm|8x8", path) == B  # from the file, as a new process would


def test_a_config_tuned_for_other_kernel_code_is_not_reused(tmp_path):
    path = str(tmp_path / "dev.json")
    times = {"v1": {A: 1e-3, B: 2e-3, C: 3e-3}, "v2": {A: 3e-3, B: 2e-3, C: 1e-3}}
    calls = []

    def measure_with(version):
        return lambda config: calls.append(config) or times[version][config]

    v1, v2 = autotune.version_of("template one"), autotune.version_of("template two")
    assert v1 != v2 and v1 == autotune.version_of("template one")
    assert autotune.tuned("mm", "8x8", [A, B, C], measure_with("v1"), "triton", path, version=v1) == A
    assert autotune.tuned("mm", "8x8", [A, B, C], measure_with("v2"), "triton", path, version=v2) == C
    assert len(calls) == 12  # the second version was measured (each once, finalists twice), not read back
    assert set(json.load(open(path))) == {f"mm@{v1}|8x8", f"mm@{v2}|8x8"}


def test_other_process_reads_the_cache_and_merges_its_own(tmp_path):
    path = str(tmp_path / "dev.json")
    autotune.store("mm|1", B, 1e-4, path)
    code = f"""
from xkern.kernels import launch as L
from xkern.tuning import autotune
assert autotune.lookup("mm|1", {path!r}) == L.Config.of(BLOCK_M=128, num_warps=8, num_stages=3)
autotune.store("mm|2", L.Config.of(BLOCK_M=64, num_warps=4), 2e-4, {path!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    autotune._MEMORY.clear()
    assert autotune.lookup("mm|1", path) == B and autotune.lookup("mm|2", path) == A


def test_processes_storing_at_once_keep_every_key(tmp_path):
    """Three processes write 150 keys each into one file at once (ranks of a job tuning at start-up):
    every key is kept (each merge reads the file under the lock)."""
    path = str(tmp_path / "dev.json")
    code = f"""
import sys
from xkern.kernels import launch as L
from xkern.tuning import autotune
for i in range(150):
    autotune.store(f"mm|{{sys.argv[1]}}-{{i}}", L.Config.of(BLOCK_M=64, num_warps=4), 1e-4, {path!r})
"""
    workers = [subprocess.Popen([sys.executable, "-c", code, str(n)]) for n in range(3)]
    assert [w.wait() for w in workers] == [0, 0, 0]
    assert set(json.load(open(path))) == {f"mm|{n}-{i}" for n in range(3) for i in range(150)}


def test_unreadable_or_stale_cache_is_retuned(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text("{ not json")
    autotune._MEMORY.clear()
    assert autotune.tuned("mm", "k", [A, B], lambda c: {A: 2.0, B: 1.0}[c], "triton", str(path)) == B
    path.write_text(json.dumps({"mm|k": {"meta": {}, "num_warps": 3}}))  # invalid entry
    autotune._MEMORY.clear()
    assert autotune.tuned("mm", "k", [A, B], lambda c: {A: 1.0, B: 2.0}[c], "triton", str(path)) == A


def test_a_cached_config_the_candidates_do_not_offer_is_retuned(tmp_path):
    """An entry edited by hand, or written when the config space offered a tile it no longer does
    (one withdrawn for miscompiling), is measured again, not launched."""
    path = tmp_path / "dev.json"
    for entry in ({"meta": {"BLOCK_M": 256}, "num_warps": 8, "num_stages": 3},  # a tile not offered
                  {"meta": {"BLOCK_M": "128"}, "num_warps": 8, "num_stages": 3},  # a string
                  {"meta": {"BLOCK_Q": 128}, "num_warps": 8, "num_stages": 3},  # another name
                  {"meta": {"BLOCK_M": 128}, "num_warps": 8, "num_stages": 2.5}):  # (int() would make it 2)
        path.write_text(json.dumps({"mm|k": entry}))
        autotune._MEMORY.clear()
        calls = []
        got = autotune.tuned("mm", "k", [A, B], lambda c: calls.append(c) or {A: 2.0, B: 1.0}[c], "triton",
                             str(path))
        assert got == B and calls, entry
        assert autotune.lookup("mm|k", str(path)) == B  # the file now holds the measured winner


def test_a_cache_that_cannot_be_written_warns_once_and_tunes(tmp_path, monkeypatch):
    """A read-only cache folder (a cache shipped in an image): the tuned config is used, this process
    remembers it, and one warning says how to keep it; no half-written file is left."""
    path = str(tmp_path / "dev.json")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(autotune.tempfile, "mkstemp", refuse)
    monkeypatch.setattr(autotune, "_UNWRITABLE", set())
    autotune._MEMORY.clear()
    with pytest.warns(RuntimeWarning, match="cannot be written to .*dev.json.*XKERN_CACHE_DIR"):
        assert autotune.tuned("mm", "a", [A, B], lambda c: {A: 2.0, B: 1.0}[c], "triton", path) == B
    fail = lambda config: pytest.fail("measured again")
    assert autotune.tuned("mm", "a", [A, B], fail, "triton", path) == B  # from memory
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned("mm", "b", [A, B], lambda c: {A: 1.0, B: 2.0}[c], "triton", path) == A
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "dev.json").exists()


def test_no_tuning_off_gpu_or_when_disabled(tmp_path, monkeypatch):
    fail = lambda config: pytest.fail("measured")
    assert autotune.tuned("mm", "k", [A, B], fail, "interpret", str(tmp_path / "x.json")) == A
    monkeypatch.setenv(autotune.ENV_VAR, "0")
    assert autotune.tuned("mm", "k", [A, B], fail, "triton", str(tmp_path / "x.json")) == A
    monkeypatch.setenv(autotune.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="XKERN_AUTOTUNE"):
        autotune.enabled()
    with pytest.raises(ValueError, match="XKERN_AUTOTUNE must be one of 0, 1, .*; got 'maybe'"):
        autotune.tuned("mm", "k", [A, B], fail, "interpret", str(tmp_path / "x.json"))  # on every backend


def test_config_json_round_trip():
    for config in (A, B, C, *matmul_configs(8192, 8192, 8192, "triton")):
        assert autotune.from_json(json.loads(json.dumps(autotune.to_json(config)))) == config


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_matmul_candidates_fit_the_problem(vendor):
    for m, n, k in ((8192, 8192, 8192), (7, 1000, 33), (4096, 16, 4096)):
        configs = matmul_configs(m, n, k, "triton", vendor)
        assert len(configs) == len(set(configs)) >= 1
        for c in configs:
            assert 16 <= c["BLOCK_M"] <= max(16, L.next_pow2(m))
            assert 16 <= c["BLOCK_N"] <= max(16, L.next_pow2(n))
            if vendor == "rocm":
                assert c.num_warps * 64 <= 1024 and c.num_stages <= 2


def test_candidates_run_now_even_inside_a_trace():
    """Tuning happens while the user's program is traced; its timing runs must execute, not be
    staged into that program (as 2 GB of captured constants and a bogus winner)."""
    import jax
    import numpy as np

    seen = []

    def measure(config):
        x = jax.device_put(np.ones((4, 4), np.float32))
        y = jax.jit(lambda a: a * config["BLOCK_M"])(x)
        seen.append(float(y[0, 0]))  # a tracer here would raise
        return 1.0 / config["BLOCK_M"]

    jax.jit(lambda x: x + autotune.best([A, B], measure)[0]["BLOCK_M"])(1.0)
    assert seen == [64.0, 128.0, 64.0, 128.0]  # each, then both again as finalists
