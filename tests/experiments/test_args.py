"""experiments/args.py: the benchmarks' list flags checked one way."""

import pytest

from experiments.args import int_list


def test_int_list_keeps_the_order_and_names_what_was_received():
    assert int_list("--workers", ["4", "1", "2"], 1) == [4, 1, 2]
    assert int_list("--workers", [2, 2], 2) == [2, 2]
    with pytest.raises(ValueError, match=r"^--workers must be integers >= 2 \(a reason\), "
                                         r"e.g. 2,4. Received: '1,2'$"):
        int_list("--workers", ["1", "2"], 2, why="a reason", example="2,4")
    with pytest.raises(ValueError, match=r"^--inter_op must be integers >= 1. Received: 'x'$"):
        int_list("--inter_op", ["x"], 1)
    with pytest.raises(ValueError, match=r"Received: ''$"):
        int_list("--workers", [], 1)
    with pytest.raises(ValueError, match=r"Received: ''$"):
        int_list("--workers", None, 1)
