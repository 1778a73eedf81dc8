"""The hostile TF_CONFIG corpus (hostile_tf_config.py) through `--check` and every preset.

Every case must end as a clean error or a correct acceptance: no traceback,
no invalid input accepted quietly, no process lost, no hang. (Two hangs are
gone: a single-task cluster whose own address is another host used to block
TensorFlow's server start forever, and a ps/worker task of a cluster without
a chief used to serve forever; the parameter_server preset now refuses that
cluster before serving.)
"""

import pytest

from tests.cluster import hostile_tf_config as corpus_lib


def test_corpus_is_large_and_labelled_uniquely():
    cases = corpus_lib.corpus()
    assert len(cases) >= 100
    assert len({c["label"] for c in cases}) == len(cases)
    assert sum(c["valid"] is False for c in cases) >= 80


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_hostile_tf_configs_get_clean_errors_everywhere():
    import tfdist

    report = corpus_lib.run_all(list(tfdist.available_presets()), timeout=400)
    if "skipped" in report:
        pytest.skip(report["skipped"])
    table, counts = corpus_lib.tables(report)
    print(table)
    problems = []
    for runner, c in counts.items():
        for label, kind, etype, message in c["_bad"]:
            problems.append(f"{runner}: {kind}: {label}: {etype} {message}")
    assert not problems, "\n".join(problems)
    # Valid input is accepted by --check and by the cluster presets.
    assert counts["check"]["accepted"] == sum(c["valid"] is not False
                                              for c in corpus_lib.corpus())
