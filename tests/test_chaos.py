"""The chaos and fuzz run (tests/chaos.py) at CI scale, in a network namespace of its own: hostile
bodies, then concurrent PD load with client disconnects, KV packets reset at random and a decode
worker SIGKILLed mid-run. `unshare -n python tests/chaos.py --full` is the full-scale run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# a minute of load on a real cluster; `python tests/chaos.py` runs it at full scale
pytestmark = pytest.mark.slow

CHAOS = Path(__file__).resolve().parent / "chaos.py"


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("iptables")):
        return False
    probe = subprocess.run(["unshare", "-n", "iptables", "-L", "-n"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_make_namespaces(), reason="needs root, unshare and iptables")
def test_chaos_run_ends_clean(tmp_path):
    summary_path = tmp_path / "summary.json"
    source = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
    )
    result = subprocess.run(
        ["unshare", "-n", sys.executable, str(CHAOS), "--json", str(summary_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert summary_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["failed_checks"] == [], json.dumps(summary, indent=1)
    assert result.returncode == 0
    outcomes = summary["outcomes"]
    # the run exercised what it claims: answers compared, clients left, packets reset, a kill
    assert outcomes["identical"] >= summary["requests"] // 2
    assert outcomes["disconnected"] > 0
    assert summary["packets_reset"] > 0
    assert summary["load"]["killed"]
    assert summary["fuzz"]["statuses"]
