"""The HLO readers the benchmarks report with."""

import numpy as np
import pytest

from jpack._reference import count_collectives, replica_groups


def test_counts_ops_arrays_and_result_bytes():
  hlo = """
  %all-reduce = (f32[4]{0}, f32[2,3]{1,0}) all-reduce(f32[4]{0} %a, f32[2,3]{1,0} %b), to_apply=%add
  %all-reduce.1 = f32[] all-reduce(f32[] %x), replica_groups={}
  %ars = (f32[8]) all-reduce-start(f32[8] %y)
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %z), dimensions={0}
  %ag = f32[8]{0} all-gather(f32[2]{0} %rs), dimensions={0}
  %d = f32[8]{0} all-gather-done(%ag)
  """
  c = count_collectives(hlo)
  assert c.count == {"all-reduce": 3, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 0}
  assert c.arrays == 6
  # async -start results are not counted (their "done" op holds the value)
  assert c.result_bytes == {"all-reduce": 4 * (4 + 6 + 1), "reduce-scatter": 8,
                            "all-gather": 32, "all-to-all": 0}
  assert c.short() == "AR3 RS1 AG1"


def test_narrow_wire_all_to_all_and_long_tuples():
  # A narrow wire (comm_dtype=bf16) reduces through all-to-all: it must show up too.
  a2a = "%a = (u16[1,4]{1,0}, u16[1,4]{1,0}) all-to-all(u16[1,4]{1,0} %p, u16[1,4]{1,0} %q)"
  c = count_collectives(a2a)
  assert c.count["all-to-all"] == 1 and c.arrays == 2 and c.result_bytes["all-to-all"] == 16
  # XLA marks long tuples with /*index=N*/ comments; they must not break the parse.
  n = 12
  types = ", ".join(f"{'/*index=5*/' if i == 5 else ''}f32[2]{{0}}" for i in range(n))
  args = ", ".join(f"f32[2]{{0}} %p{i}" for i in range(n))
  c = count_collectives(f"%t = ({types}) all-reduce({args}), to_apply=%add")
  assert c.count["all-reduce"] == 1 and c.arrays == n and c.result_bytes["all-reduce"] == 8 * n
  assert count_collectives("%m = f32[2]{0} multiply(%a, %b)").short() == "-"


@pytest.mark.parametrize("text,want", [
    ("replica_groups={{0,4},{1,5}}", [[0, 4], [1, 5]]),
    ("replica_groups=[2,4]<=[8]", np.arange(8).reshape(2, 4).tolist()),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", np.arange(8).reshape(2, 4).T.tolist()),
    ("replica_groups=mesh['a'=2,'b'=4] {'b'}", np.arange(8).reshape(2, 4).tolist()),
    ("replica_groups=mesh['a'=2,'b'=4] {'a'}", np.arange(8).reshape(2, 4).T.tolist()),
    # Mesh position p holds device arange(64).reshape(8, 8).T.ravel()[p].
    ("replica_groups=mesh['a'=8,'b'=1,'c'=8], device_ids=([8,8]T(1,0)) {'c'}",
     np.arange(64).reshape(8, 8).T.tolist()),
    ("replica_groups=mesh['a'=8,'b'=8], device_ids=([8,8]T(1,0)) {'a'}",
     np.arange(64).reshape(8, 8).tolist()),
])
def test_replica_groups_in_every_form_xla_prints(text, want):
  assert replica_groups(text + ", use_global_device_ids=true") == want
