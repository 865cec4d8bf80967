"""The torch warnings silenced around the project's state-dict calls: exactly those, only inside the block.  Pure."""

from __future__ import annotations

import warnings

from accelpact_slurm.core.torch_warnings import TORCH_STATE_DICT_WARNINGS, quiet_state_dict_calls

NOISE = [("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning),
         ("`_get_pg_default_device` will be deprecated, it only stays for backward-compatibility reason.", UserWarning),
         ("Multiple backends are registered with this ProcessGroup. We cannot determine which one is the default. "
          "Returning cpu. Please consider using other APIs.", UserWarning),
         ("FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated. Please use APIs, "
          "get_state_dict() and set_state_dict()", FutureWarning)]


def _shown(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [(str(w.message), w.category) for w in got]


def _warn_all(extra=()):
    for message, category in [*NOISE, *extra]:
        warnings.warn(message, category)


def test_torchs_noise_is_ignored_inside_the_block_and_shown_outside_it():
    assert len(NOISE) == len(TORCH_STATE_DICT_WARNINGS)
    assert _shown(_warn_all) == NOISE  # the negative control: each is a warning Python shows

    def inside():
        with quiet_state_dict_calls():
            _warn_all()
        _warn_all()

    assert _shown(inside) == NOISE


def test_the_users_own_warnings_and_other_categories_pass_through_the_block():
    mine = [("my model's own warning", UserWarning),
            ("Please use DTensor instead and we are deprecating ShardedTensor.", UserWarning),  # another category
            ("see: `_get_pg_default_device` will be deprecated", UserWarning)]  # not at the message's start

    def inside():
        with quiet_state_dict_calls():
            _warn_all(mine)

    assert _shown(inside) == mine


def test_as_a_decorator_each_call_is_quiet():
    @quiet_state_dict_calls()
    def call():
        _warn_all()

    assert _shown(lambda: (call(), call())) == []
