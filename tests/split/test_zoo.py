"""split_model and the cost model on KerasHub models (tests/zoo.py), in a fresh process.

A representative subset runs here (a tied GPT-2, XLNet, the MobileNet whose
rebuilt blocks used to be misnamed, ViT and Swin with configs that do not
round-trip, a mixture of experts); the full zoo with its counts:
`python -m tests.split.run_zoo` (tests/split/run_zoo.py says what each count means).
"""

import pytest

from tests import zoo
from tests.support import run_python

SUBSET = ["GPT2", "XLNet", "MobileNet", "ViT", "SwinTransformer", "Mixtral"]


@pytest.mark.timeout(400)
@pytest.mark.skipif(not zoo.AVAILABLE, reason=zoo.SKIP_REASON or "keras-hub missing")
def test_zoo_subset_splits_trains_equal_placed_and_costs_match_the_profiler():
    result = run_python("-m", "tests.split.run_zoo", *SUBSET, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    n = len(SUBSET)
    assert (f"split accepted {n}/{n}; trains equal (<= 1e-05) and fully placed {n}/{n}; "
            f"cost FLOPs within 0.6-1.4x of the profiler {n}/{n}") in result.stdout, \
        result.stdout[-3000:]
