"""The peak of plan's 8x768 config under 1.5 GiB (the config of tests/test_plan.py::test_plan_config_trains_under_the_cap)
with ``titan.hms.pooled_reads`` on or off, measured under a roomy 4 GiB cgroup (``titan_ds.memcap.run_capped``).

    PYTHONPATH=$PWD python launch/experiments/pool_peak.py 1   # pooled reads on; 0: off

Prints the peak anonymous memory and the cgroup's high-water mark. Run the two settings alternated, alone.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_ds.memcap import run_capped
from titan_ds.plan import model_spec, parse_size

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    pooled = sys.argv[1] == "1"
    cap, spec = "1.5G", "gpt:8x768"
    tmp = Path(tempfile.mkdtemp())
    out = tmp / "cfg.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "titan_ds.cli", "plan", "--model", spec, "--cpu-mem", cap, "--disk", "10G",
                    "--out", str(out), "--nvme-path", str(tmp / "nvme")], check=True, capture_output=True, env=env)
    cfg = json.loads(out.read_text())
    cfg["titan"]["hms"]["pooled_reads"] = pooled
    out.write_text(json.dumps(cfg))
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(out), "--steps", "2",
           *model_spec(spec).gpt_args, "--micro-batch", "1", "--val-batches", "1", "--warmup", "1", "--no-progress",
           "--summary-out", str(tmp / "s.json"), "--zero-init"]
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000))
    r = run_capped(cmd, int(parse_size("4G")), env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=900)
    print(f"pooled_reads={pooled}", "ok" if r.ok else "FAIL",
          f"peak_anon GiB {r.peak_anon_bytes / 2**30:.3f} max_usage GiB {r.max_usage_bytes / 2**30:.3f}")


if __name__ == "__main__":
    main()
