"""KerasHub models under `mirrored` x2 equal one device (the zoo).

A representative subset runs here (one fresh process, 2 logical CPUs): a
decoder LLM with token and position embeddings (GPT2) and a BatchNorm CNN
(ResNet). Reference: one device, the same initial weights, 3 steps at global
batch 8; SGD over every variable (<= 1e-5), Adam against one device on summed
sparse gradients judged on the embedding tables (<= 1e-4). The whole zoo:
`python tests/numerics/run_zoo.py` (counts in docs/numerics.md). HGNetV2 (grouped
convolutions) also runs under ZeRO-3 (`--shard parameters`).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests import zoo
from tests.support import REPO, run_python

pytestmark = pytest.mark.skipif(not zoo.AVAILABLE, reason=zoo.SKIP_REASON)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zoo_subset_equals_one_device():
    proc = run_python(os.path.join(REPO, "tests", "numerics", "run_zoo.py"),
                      "--families", "GPT2,ResNet", timeout=840)
    rows = {json.loads(m)["family"]: json.loads(m)
            for m in re.findall(r"^ROW (.*)$", proc.stdout, re.MULTILINE)}
    assert proc.returncode == 0 and set(rows) == {"GPT2", "ResNet"}, \
        proc.stdout[-3000:] + proc.stderr[-5000:]
    gpt2, resnet = rows["GPT2"], rows["ResNet"]
    assert gpt2["sgd"] <= 1e-5 and gpt2["adam_embedding"] <= 1e-4 and gpt2["spread"] <= 1e-6
    # ResNet: per-replica batch statistics differ from one device's; with
    # sync_batch_norm the run equals one device. Replicas stay identical either way.
    assert resnet["sgd"] > 1e-3 and resnet["sgd_sync"] <= 1e-5 and resnet["spread"] <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_zero3_on_grouped_convolutions_equals_one_device():
    # HGNetV2's grouped convolutions run in a nested XLA function (Keras on CPU), where no
    # collective runs: stage 3 gathers their kernels in the layer's own graph. Without that,
    # the step fails at the CollectiveGatherV2 inside the XLA function.
    proc = run_python(os.path.join(REPO, "tests", "numerics", "run_zoo.py"),
                      "--families", "HGNetV2", "--shard", "parameters", timeout=840)
    rows = [json.loads(m) for m in re.findall(r"^ROW (.*)$", proc.stdout, re.MULTILINE)]
    assert proc.returncode == 0 and len(rows) == 1 and "error" not in rows[0], \
        proc.stdout[-3000:] + proc.stderr[-5000:]
    # Per-replica batch statistics differ from one device's; with sync_batch_norm it is equal.
    assert rows[0]["sgd"] > 1e-3 and rows[0]["sgd_sync"] <= 1e-5 and rows[0]["spread"] <= 1e-6


def test_every_family_has_a_name_kind_and_known_tags():
    assert len(zoo.FAMILIES) >= 48
    for family in zoo.FAMILIES.values():
        assert family.kind in {"text", "seq2seq", "audio", "image"}
        assert family.tags <= {"batchnorm", "embedding", "moe", "dropout"}
    assert len(zoo.families(tags={"batchnorm"})) == 7
    assert {f.name for f in zoo.families(tags={"moe"})} >= {"Mixtral", "QwenMoe", "Qwen3Moe"}
