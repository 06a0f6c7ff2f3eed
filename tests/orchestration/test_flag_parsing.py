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
