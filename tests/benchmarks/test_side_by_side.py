"""scripts/gpu_side_by_side.sh on CPU: each group runs with its own GPUs, port, results folder and deadline, side
by side; its exit status and output are kept, and everything is packed into one archive."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_groups_run_side_by_side(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TOTAL_S="100", SHAPES="")
    groups = [
        "0|a|echo gpus=$CUDA_VISIBLE_DEVICES port=$PORT out=$OUT logs=$LOGS left=$(left); sleep 1; echo a-done",
        "2,3|b|echo gpus=$CUDA_VISIBLE_DEVICES port=$PORT; sleep 1; exit 3",
    ]
    r = subprocess.run(
        ["bash", "scripts/gpu_side_by_side.sh", *groups], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    a = (tmp_path / "a" / "run.log").read_text().split()
    assert a[:4] == ["gpus=0", "port=8200", f"out={tmp_path / 'a'}", f"logs={tmp_path / 'a' / 'logs'}"]
    assert 90 <= int(a[4].removeprefix("left=")) <= 100 and a[5] == "a-done"
    assert (tmp_path / "b" / "run.log").read_text().split() == ["gpus=2,3", "port=8202"]
    assert "== a (GPUs 0): rc=0" in r.stdout and "== b (GPUs 2,3): rc=3" in r.stdout
    with tarfile.open(tmp_path / "side_by_side.tgz") as t:
        assert {"./a/run.log", "./b/run.log"} <= set(t.getnames())
