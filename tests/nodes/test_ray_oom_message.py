"""Ray's memory monitor stopping a rank reaches the user as one sentence with the figure (Ray's own exception)."""

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

from patchray.nodes.bridge.errors import for_user, user_message  # noqa: E402

# the head of what Ray 2.60 raised when a Distributed KSampler run on 3 CPU ranks filled this 24 GiB machine
_REPORT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, ID: d411ebb6e7b0) "
    "was 22.35GB used / 23.54GB limit (0.949354)\nOOM kill reason: Memory usage 24055840768B exceeded threshold\n"
    "Object store memory usage: [- objects spillable: 1\n- bytes spillable: 57391801\n]\nTop 10 memory users: PID\tMEM(GB)\n"
    "27381\t4.75\tray::_RankActor.call\nRefer to the documentation on how to address the out of memory issue: https://docs.ray.io/"
)


def test_the_memory_kill_is_one_sentence_with_the_figure():
    exc = ray_exceptions.OutOfMemoryError(_REPORT)
    text = user_message(exc)
    assert text.startswith("Ray stopped a rank because the machine ran out of memory (22.35GB used / 23.54GB limit)")
    assert "fewer CPU ranks" in text and "\n" not in text and "PID" not in text and "docs.ray.io" not in text
    assert str(for_user(exc)) == text


def test_other_errors_keep_their_text():
    assert user_message(ValueError("width must be a multiple of 8")) == "width must be a multiple of 8"
