"""The one in-process parameter-server strategy of a pytest process (2 workers, 2 ps).

tests/ps/test_fit.py runs tests/ps/run_fit_cases.py and tests/ps/run_parity_cases.py
in one pytest process: TensorFlow servers cannot be stopped and a process
talks to one cluster, so both modules' cases share this strategy.
"""

import functools

NUM_WORKERS = 2


@functools.cache
def strategy():
    import tfdist

    return tfdist.make_strategy("parameter_server", local_workers=NUM_WORKERS, local_ps=2,
                                skip_completed_reruns=True)
