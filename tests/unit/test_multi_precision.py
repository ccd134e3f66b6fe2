"""multi_precision on one process: the master copy in the state, its config, its errors."""

import numpy as np
import pytest

from mpikv import optimizer as opt
from mpikv.errors import OptimizerError


def test_half_weights_get_a_float32_master_in_their_state():
    sgd = opt.SGD(learning_rate=0.1, momentum=0.9, multi_precision=True)
    w = np.array([1.0, 2.0], np.float16)
    state = sgd.create_state(0, w)
    assert sorted(state) == ["mom", "t", opt.MASTER]
    assert state[opt.MASTER].dtype == np.float32 and state[opt.MASTER].tolist() == [1.0, 2.0]
    assert sgd.state_names_for(np.float16) == ("mom", opt.MASTER, "t")
    # float32 and float64 weights need no master.
    assert sgd.state_names_for(np.float32) == sgd.state_names == ("mom", "t")
    assert opt.MASTER not in sgd.create_state(0, np.zeros(2, np.float32))


def test_the_master_accumulates_what_the_weight_cannot_hold():
    w = np.ones(3, np.float16)
    plain, mp = opt.SGD(learning_rate=1e-4), opt.SGD(learning_rate=1e-4, multi_precision=True)
    w_plain, w_mp = w.copy(), w.copy()
    s_plain, s_mp = plain.create_state(0, w_plain), mp.create_state(0, w_mp)
    ref = np.ones(3, np.float32)
    for _ in range(20):
        plain.update(0, w_plain, np.ones(3, np.float16), s_plain)
        mp.update(0, w_mp, np.ones(3, np.float16), s_mp)
        ref -= np.float32(1e-4) * np.ones(3, np.float32)
    assert (w_plain == 1.0).all()   # 1e-4 is under half a float16 step at 1.0: lost each time
    np.testing.assert_array_equal(s_mp[opt.MASTER], ref)
    np.testing.assert_array_equal(w_mp, ref.astype(np.float16))


def test_config_round_trips_and_is_checked():
    adam = opt.Adam(multi_precision=True)
    assert adam.get_config()["multi_precision"] is True
    assert opt.from_config(adam.get_config()).multi_precision is True
    assert "multi_precision" not in opt.Adam().get_config()   # old files: unchanged configs
    with pytest.raises(TypeError, match="multi_precision must be a bool"):
        opt.SGD(multi_precision="yes")


def test_a_state_without_its_master_is_refused():
    sgd = opt.SGD(momentum=0.9, multi_precision=True)
    w = np.ones(2, np.float16)
    state = opt.SGD(momentum=0.9).create_state(0, w)
    with pytest.raises(OptimizerError, match="needs \\['mom', 't', 'weight32'\\]"):
        sgd.update(0, w, np.ones(2, np.float16), state)


def test_updater_states_with_masters_round_trip():
    updater = opt.get_updater(opt.Adam(multi_precision=True))
    w = np.ones(3, np.float16)
    updater(1, np.ones(3, np.float16), w)
    other = opt.get_updater(opt.Adam(multi_precision=True))
    other.set_states(updater.get_states())
    assert sorted(other.states[1]) == ["mean", "t", "var", opt.MASTER]
