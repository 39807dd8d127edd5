"""runtime/flags.py: every SAILFISH_* variable through one parser; clear_caches() re-reads the
kernel switches."""
import pytest

from sailfish.runtime import flags
from sailfish.runtime.flags import FLAGS
from sailfish.tuning import clear_caches


@pytest.fixture
def fresh_flags(monkeypatch):
    for var in ("SAILFISH_GLUON", "SAILFISH_GEMV_MMA", "SAILFISH_PAIRED_SCALES", "SAILFISH_SCALE_PREFETCH",
                "SAILFISH_ACC_FENCE", "SAILFISH_SPLIT_FIXUP", "SAILFISH_PDL", "SAILFISH_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    monkeypatch.undo()
    clear_caches()  # (the switches as the environment has them again)


def test_defaults(fresh_flags):
    clear_caches()
    assert (FLAGS.gluon, FLAGS.gemv_mma, FLAGS.paired_scales, FLAGS.split_fixup) == (True, True, True, True)
    assert (FLAGS.scale_prefetch, FLAGS.acc_fence, flags.pdl_mode()) == ("auto", "auto", "auto")
    assert not flags.autotune()


def test_clear_caches_rereads_the_kernel_switches(fresh_flags):
    fresh_flags.setenv("SAILFISH_GEMV_MMA", "0")
    fresh_flags.setenv("SAILFISH_SCALE_PREFETCH", "1")
    fresh_flags.setenv("SAILFISH_SPLIT_FIXUP", "off")
    assert FLAGS.gemv_mma  # read at import / the last clear_caches, not per call
    clear_caches()
    assert not FLAGS.gemv_mma and FLAGS.scale_prefetch == "1" and not FLAGS.split_fixup
    fresh_flags.delenv("SAILFISH_GEMV_MMA")
    clear_caches()
    assert FLAGS.gemv_mma


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), (" ON ", True), ("yes", True),
                                         ("0", False), ("False", False), ("off", False), ("", False)])
def test_one_boolean_parser(fresh_flags, value, want):
    fresh_flags.setenv("SAILFISH_AUTOTUNE", value)
    assert flags.autotune() is want


@pytest.mark.parametrize("var, value", [("SAILFISH_GLUON", "2"), ("SAILFISH_ACC_FENCE", "sometimes"),
                                        ("SAILFISH_GEMV_MMA", "auto")])
def test_bad_values_name_the_variable(fresh_flags, var, value):
    fresh_flags.setenv(var, value)
    with pytest.raises(ValueError, match=rf"{var}='{value}' is not understood; allowed: 1 / 0"):
        clear_caches()


def test_pdl_mode_is_read_per_question(fresh_flags):
    fresh_flags.setenv("SAILFISH_PDL", "0")
    assert flags.pdl_mode() == "0"
    fresh_flags.setenv("SAILFISH_PDL", "bogus")
    with pytest.raises(ValueError, match="SAILFISH_PDL='bogus'"):
        flags.pdl_mode()
