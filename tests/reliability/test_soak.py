"""The soak benchmark (launch/bench/soak.py): its checks on synthetic samples (each must be able to fail), and
the script itself on a short budget with the same assertions the 3000-step run makes (every pillar, 2 ranks,
ZeRO-3 + HMS, checkpoints, bit-exact resume from the last checkpoint)."""
import importlib.util
import json
import sys

import pytest

from tests.helpers.launch import ROOT, clean_env, run

_spec = importlib.util.spec_from_file_location("soak", ROOT / "launch" / "bench" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


def _samples(rss_end: float = 1.0, fds_end: int = 20, threads_end: int = 8, tmp_end: int = 0) -> list[dict]:
    out = []
    for step in range(1, 41):
        late = step >= 30
        r = {"rss": int(500e6 * (rss_end if late else 1.0)), "fds": fds_end if late else 20,
             "threads": threads_end if late else 8, "shm_maps": 1}
        out.append({"t": step, "step": step, "ranks": {"0": dict(r), "1": dict(r)},
                    "tmp_files": tmp_end if late else 0, "hms_files": 10, "dev_shm_files": 2})
    return out


def _failed(samples: list[dict]) -> list[str]:
    res = soak.analyse(samples, steps=40, save_every=10, ranks=2, rss_growth=0.02)
    return [c["check"] for c in res["checks"] if not c["ok"]]


def test_checks_pass_on_flat_samples():
    assert _failed(_samples()) == []


@pytest.mark.parametrize("kw, what", [({"rss_end": 1.03}, "RSS growth"), ({"fds_end": 21}, "fds"),
                                      ({"threads_end": 9}, "threads"), ({"tmp_end": 1}, "tmp_files")])
def test_each_check_fails_on_growth(kw, what):
    failed = _failed(_samples(**kw))
    assert failed and all(what in c for c in failed), failed


def test_a_transient_fd_in_the_end_window_is_not_a_leak():
    """One sample with a file open for a checkpoint write (CI: rank 1 fds 18 -> 19) passes; the same fd held
    through the whole end window fails (test_each_check_fails_on_growth)."""
    samples = _samples()
    samples[33]["ranks"]["1"]["fds"] += 1
    assert _failed(samples) == []


def test_rss_growth_inside_the_bound_passes():
    assert _failed(_samples(rss_end=1.015)) == []


def test_too_few_samples_is_a_failure_not_a_pass():
    assert _failed(_samples()[:5]) == ["enough samples in both windows"]


@pytest.mark.slow
@pytest.mark.heavy
def test_soak_short_budget(tmp_path):
    """40 steps, a checkpoint every 10: RSS, fds, threads, shm maps, temporary and HMS files flat after the
    first checkpoint; resuming from step 30 reproduces steps 31-40 bit for bit."""
    out = tmp_path / "out"
    r = run([sys.executable, str(ROOT / "launch" / "bench" / "soak.py"), "--steps", "40", "--save-every", "10",
             "--tiny", "--sample-s", "0.5", "--timeout", "900", "--work", str(tmp_path / "work"), "--out", str(out)],
            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=1200)
    result = json.loads((out / "soak.json").read_text()) if (out / "soak.json").exists() else {}
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + (out / "soak_log.txt").read_text()[-3000:]
    assert result["ok"] and result["figures"]["ref_samples"] >= 2 and result["figures"]["end_samples"] >= 2
    assert any("bit-exact" in c["check"] and c["ok"] for c in result["checks"])
    assert (out / "soak_rss.png").stat().st_size > 0
