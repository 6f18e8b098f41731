"""runtime/aot.py: collectives counted in compiled HLO text, bytes per device."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_agentic.runtime.aot import collective_counts, peak_bytes, shard_bytes

# The shapes of XLA:TPU's text: an async all-gather pair, a reduce-scatter fusion whose
# computation holds an all-reduce, a plain all-reduce, an async custom call, and operand
# names that contain opcodes (not instructions).
HLO = """\
%all-reduce-scatter.3 (input: f32[4,128]) -> f32[1,128] {
  %all-reduce.9 = f32[4,128]{1,0} all-reduce(f32[4,128]{1,0} %input), replica_groups={}
  ROOT %slice = f32[1,128]{1,0} slice(%all-reduce.9), slice={[0:1], [0:128]}
}

ENTRY %main.1 (p: f32[1,128]) -> f32[1,128] {
  %all-gather-start.2 = (f32[1,128], f32[4,128]) all-gather-start(f32[1,128]{1,0} %p)
  %all-gather-done.2 = f32[4,128]{1,0} all-gather-done(%all-gather-start.2)
  %fusion.7 = f32[1,128]{1,0} fusion(%all-gather-done.2), kind=kCustom, calls=%all-reduce-scatter.3
  %all-reduce.1 = f32[1,128]{1,0} all-reduce(f32[1,128]{1,0} %fusion.7), to_apply=%add
  %cc.4 = f32[1,128]{1,0} custom-call(%all-reduce.1), custom_call_target="AsyncCollectiveStart"
  ROOT %copy = f32[1,128]{1,0} copy(%cc.4)
}
"""


def test_collective_counts_by_hand():
    assert collective_counts(HLO) == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1,
                                      "all-to-all": 0, "collective-permute": 0,
                                      "async_custom_calls": 1}


def test_shard_bytes_and_peak():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    tree = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                      sharding=NamedSharding(mesh, P("data"))),
            "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                        sharding=NamedSharding(mesh, P()))}
    assert shard_bytes(tree) == 8 * 4 * 4 + 8  # one device: the whole array; a key is 2×u32
    figures = {"argument_bytes": 100, "output_bytes": 50, "alias_bytes": 40,
               "temp_bytes": 7, "generated_code_bytes": 3}
    assert peak_bytes(figures, resident=1000, resident_arguments=60) == 1000 + 40 + 10 + 10
