"""The mesh axes the kernels split their operands over: rows (or tokens) over
``BATCH_AXES``, attention heads over ``HEAD_AXIS``, and a packed row's positions over
``CONTEXT_AXIS`` (context parallelism: ``context_attention``).

This is the learner's mesh convention; ``jaxrl_agentic.runtime.parallel`` owns it and hands these
names on as its own (its mesh is ``(*BATCH_AXES, HEAD_AXIS, CONTEXT_AXIS)``). They are defined
here, in the package that imports only jax, so that both sides read one definition and no
arrow runs from the kernels up to the trainer.
"""

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"
CONTEXT_AXIS = "context"
