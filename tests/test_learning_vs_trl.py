"""scripts/analysis/learning_vs_trl.py: the training stream both sides take, the prompt digests
that check it, and the plot (the training itself runs minutes: it is the script's own run)."""

import pytest
from PIL import Image

from tests.conftest import load_script


@pytest.fixture(scope="module")
def lvt():
    return load_script("scripts/analysis/learning_vs_trl.py")


def test_the_stream_is_make_prompts_in_order_without_the_held_out_problems(lvt):
    full = lvt.protocol.make_prompts(12, 0)
    held_out = {full[3][0], full[7][0]}
    stream = lvt.training_stream(10, 0, held_out)
    expected = [p for p in lvt.protocol.make_prompts(14, 0) if p[0] not in held_out][:10]
    assert stream == expected and len(stream) == 10
    assert not held_out & {t for t, _ in stream}
    assert lvt.training_stream(5, 0, set()) == full[:5]


def test_a_steps_digest_names_its_distinct_prompts_in_order(lvt):
    group = [[1, 2], [1, 2], [3], [3]]  # TRL: a prompt per completion
    assert lvt._unique(group) == [[1, 2], [3]]
    assert lvt._digest(lvt._unique(group)) == lvt._digest([[1, 2], [3]])
    assert lvt._digest([[3], [1, 2]]) != lvt._digest([[1, 2], [3]])


def test_eval_accuracy_counts_replies_that_contain_the_answer(lvt):
    out = lvt._eval_result(["It is 42.", "41", "1,234 apples"], [42, 42, 1234], 2.0)
    assert out["accuracy"] == pytest.approx(2 / 3) and out["eval_s"] == 2.0


def test_the_plot_is_a_png_with_both_curves(lvt, tmp_path):
    path = tmp_path / "sub" / "curves.png"
    lvt.draw(str(path), {"ours": [[0.0, 0, 0.1], [1.0, 4, 0.3]],
                         "trl": [[0.0, 0, 0.1], [1.5, 4, 0.2]]}, "title")
    with Image.open(path) as image:
        assert image.size == (1200, 675)
