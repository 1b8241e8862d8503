"""kvrun.progress: the ETA's duration format and the counted progress line, redrawn in place
on a terminal and one plain line per tenth elsewhere."""
import io

import pytest

from kvrun.progress import CountProgress, format_duration


@pytest.mark.parametrize("seconds, text", [
    (0, "0 s"), (59.4, "59 s"), (60, "1 min 00 s"), (245, "4 min 05 s"),
    (3599, "59 min 59 s"), (3600, "1 h 00 min"), (7620, "2 h 07 min"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_count_progress_prints_a_line_per_tenth_off_a_terminal():
    out = io.StringIO()
    p = CountProgress("[x]", "items", stream=out, tty=False)
    for done in range(0, 21):
        p(done, 20, f"t{done}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 11                            # 0 %, 10 % … 100 %
    assert lines[0].startswith("[x] 0/20 items (0%), ")
    assert lines[-1].startswith("[x] 20/20 items (100%), ")
    assert "\r" not in out.getvalue()


def test_count_progress_redraws_one_line_on_a_terminal_and_ends_it():
    out = io.StringIO()
    p = CountProgress("[x]", "items", stream=out, tty=True)
    p(1, 3, "first")                                   # drawn: 0.1 s since t0 has not passed,
    p(3, 3, "last")                                    # but _last_draw starts at 0
    text = out.getvalue()
    assert text.startswith("\r[x] 1/3 items (33%), ") and "  first\x1b[K" in text
    assert text.endswith("\x1b[K\n") and "last" not in text   # the final line has no name
