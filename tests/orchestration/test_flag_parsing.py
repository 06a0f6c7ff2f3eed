"""tyro's refusal box told in one line, in both of the forms tyro draws it (UTF-8 output with sides, ASCII
output without); text that is not such a box is left as it is."""

from __future__ import annotations

from orchestration.flag_parsing import one_paragraph

UTF8 = """\
╭─ Unrecognized options ───────────────────────────────────────────────────────╮
│ Unrecognized options: --rollout.num-env, 3                                   │
│ ──────────────────────────────────────────────────────────────────────────── │
│ Perhaps you meant:                                                           │
│     --rollout.num-envs INT                                                   │
│         Envs stepped together by one actor (one batched forward pass per     │
│         step serves all of them). (default: 16)                              │
│ ──────────────────────────────────────────────────────────────────────────── │
│ For full helptext, run shoal train --help                                    │
╰──────────────────────────────────────────────────────────────────────────────╯
"""

ASCII = """\
 Value error
 ------------------------------------------------------------------------------
  Error parsing policy: PolicyConfig.recurrent_critic must be False unless
  recurrent is True, got True
  ------------------------------------------------------------------------------
  Argument helptext:
      --policy.recurrent-critic, --policy.no-recurrent-critic
      Whether the critic --has a memory too.
  ------------------------------------------------------------------------------
  For full helptext, see shoal train --help
"""


def test_both_forms_of_tyros_box_become_one_line_naming_the_flag():
    assert one_paragraph(UTF8, "train") == ("Unrecognized options: --rollout.num-env, 3; did you mean "
                                            "--rollout.num-envs? (shoal train --help lists every flag)")
    assert one_paragraph(ASCII, "train") == (
        "--policy.recurrent-critic must be False unless recurrent is True, got True; it takes "
        "--policy.recurrent-critic, --policy.no-recurrent-critic (shoal train --help lists every flag)")


def test_text_that_is_not_a_box_is_left_alone():
    assert one_paragraph("", "train") is None
    assert one_paragraph("UserWarning: something\n  warnings.warn(x)\n", "train") is None


SIMILAR = """\
UserWarning: a warning printed while parsing
╭─ Unrecognized options ───────────────────────────────────────────────────────╮
│ Unrecognized options: --lrr, 1, --policy.squash-bounded-action               │
│ ──────────────────────────────────────────────────────────────────────────── │
│ Arguments similar to --lrr:                                                  │
│     --lr FLOAT                                                               │
│         Adam learning rate. (default: 0.00025)                               │
│ ──────────────────────────────────────────────────────────────────────────── │
│ Arguments similar to --policy.squash-bounded-action:                         │
│     --policy.squash-bounded-actions, --policy.no-squash-bounded-actions      │
│         Bounded box actions use a tanh-squashed Gaussian. (default: True)    │
│ ──────────────────────────────────────────────────────────────────────────── │
│ For full helptext, run shoal train --help                                    │
╰──────────────────────────────────────────────────────────────────────────────╯
"""


def test_several_unknown_flags_each_get_their_suggestion_and_what_came_before_the_box_is_kept():
    """Two unknown flags: tyro heads each suggestion "Arguments similar to --X" (they were dropped); a boolean
    flag's suggestion is its pair (it came out as ``--policy.squash-bounded-actions,``)."""
    from orchestration.flag_parsing import split_refusal

    before, told = split_refusal(SIMILAR, "train")
    assert before == "UserWarning: a warning printed while parsing\n"
    assert told == ("Unrecognized options: --lrr, 1, --policy.squash-bounded-action; did you mean --lr for --lrr, "
                    "--policy.squash-bounded-actions for --policy.squash-bounded-action? (shoal train --help lists "
                    "every flag)")


def test_a_box_drawn_in_colour_is_read_as_the_plain_one():
    """A terminal gets the box with colour codes around every piece: it was passed on whole, many lines."""
    coloured = "".join(f"\x1b[31m{ch}\x1b[0m" if ch in "│╭╰─" else ch for ch in UTF8)
    assert one_paragraph(coloured, "train") == one_paragraph(UTF8, "train") is not None


def test_the_cli_tells_a_refusal_in_one_line_in_a_terminal_and_at_any_width(tmp_path):
    """Run as a user runs it: a pseudo-terminal (colours, the UTF-8 box) 40 columns wide, which wrapped a long flag
    over two rows (``--policy.no-squash-bounded-actio``)."""
    import os
    import pty
    import subprocess
    import sys

    leader, follower = pty.openpty()
    done = subprocess.run([sys.executable, "-m", "orchestration.cli", "train", "builtin:cartpole",
                           "--policy.squash-bounded-action", "--lrr", "1"], stdin=follower, stdout=follower,
                          stderr=follower, cwd=tmp_path, env={**os.environ, "COLUMNS": "40", "TERM": "xterm",
                                                               "PYTHONPATH": os.getcwd()}, timeout=120)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    text = out.decode(errors="replace").strip()
    assert done.returncode == 2 and len(text.splitlines()) == 1, text
    assert "did you mean --policy.squash-bounded-actions for --policy.squash-bounded-action, --lr for --lrr?" in text


def test_a_restores_misfit_line_is_read_without_the_colour_codes_of_a_ray_actors_traceback():
    from orchestration.run_state import shape_detail

    err = RuntimeError("\x1b[36mray::LearnerServer.load_state()\x1b[39m (pid=1)\n"  # \x1b[K: erase to the line's end
                       "\x1b[1;31mError(s) in loading state_dict: size mismatch for w: [4, 2] vs [8, 2].\x1b[0m\x1b[K")
    assert shape_detail(err) == "Error(s) in loading state_dict: size mismatch for w: [4, 2] vs [8, 2]"
