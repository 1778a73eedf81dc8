"""experiments/bench_shaped.py and experiments/netlab.py: simulated nodes on shaped links.

Network namespaces need root, `ip`, `tc` and `nsenter`; without them (or where the
kernel refuses a new namespace) every test here is skipped with the reason.
"""

import math
import os
import re
import subprocess
import sys
import time

import pytest

from experiments import bench_shaped
from experiments.netlab import NetLab
from tests.support import live_namespaces, namespaces_refused


_REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(_REFUSED is not None, reason=f"simulated nodes: {_REFUSED}")


def test_links_are_shaped_and_namespaces_go_on_error():
    with pytest.raises(RuntimeError, match="an error inside the lab"):
        with NetLab(2, rate_bits=20e6) as lab:
            held = lab.namespaces()
            assert len(held) == 3 and held <= live_namespaces()  # two nodes and the switch
            shaped = lab.probe(pings=20, total_bytes=1 << 20)["bytes_per_second"] * 8
            lab.set_rate(2e9)
            fast = lab.probe(pings=20, total_bytes=8 << 20)["bytes_per_second"] * 8
            raise RuntimeError("an error inside the lab")
    assert not held & live_namespaces()
    # 20 Mbit/s allows at most 40 (HTB's burst lets a short stream above the rate), and the
    # same link at 2 Gbit/s is faster than that: the rate is what limits it.
    assert shaped < 40e6 < fast, (shaped, fast)


def test_namespaces_go_when_their_maker_is_killed(tmp_path):
    script = ("import os, sys\n"
              "from experiments.netlab import NetLab\n"
              "lab = NetLab(2, rate_bits=1e8)\n"
              "print(' '.join(sorted(lab.namespaces())), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    held = set(out.stdout.split())
    assert out.returncode == -9 and len(held) == 3, out
    deadline = 50
    while held & live_namespaces() and deadline:  # holders die with their parent (SIGKILL)
        deadline -= 1
        time.sleep(0.1)
    assert not held & live_namespaces()


def test_bad_arguments_name_what_was_received():
    with pytest.raises(ValueError, match=r"--methods must name one or more of stock, tfdist.*"
                                         r"Received: 'tfdist,gzip'"):
        bench_shaped.check_arguments([100.0], ["tfdist", "gzip"], 1, 2)
    with pytest.raises(ValueError, match=r"--rates_mbit must be positive.*Received: \[0.0\]"):
        bench_shaped.check_arguments([0.0], ["tfdist"], 1, 2)
    with pytest.raises(ValueError, match="--steps >= 2. Received: rounds=1, steps=1"):
        bench_shaped.check_arguments([100.0], ["tfdist"], 1, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smallest_configuration_trains_on_the_shaped_link_and_cleans_up():
    labs = []
    rows = bench_shaped.run([100.0], ["tfdist"], rounds=1, steps=2, log=lambda *a: None,
                            on_lab=lambda lab: labs.append(lab.namespaces()))
    assert len(labs) == 1 and len(labs[0]) == 3
    assert not labs[0] & live_namespaces()
    (step,) = rows
    assert step["name"] == "shaped/100 Mbit/s/tfdist: step", rows
    assert math.isfinite(step["value"]) and step["value"] > 0, step
    # The gradients (669,706 float32 = 2.68 MB) cross the link once per step each way
    # (a 2-worker ring): at 100 Mbit/s that is >= 0.2 s, so the link, not the cores, sets it.
    assert step["value"] > 150, step
    assert "100 Mbit/s each way" in step["note"], step
    # Each step's 2.68 MB of gradients, plus gRPC framing and the logs' collective.
    sent = re.search(r"worker 0 sent ([\d.]+) MB/step", step["note"])
    assert sent and 2.67 <= float(sent.group(1)) < 2.8, step
