"""The passes: each a function from program to program, run in this order by
minigist.pipeline.compile:

- backward.build_program: graph -> the training (or inference) program;
- recompute.apply_recompute: stashed tensors dropped and rebuilt by re-running forward steps;
- gist.apply_gist: Gist's schedule builder (encode / decode steps, Gist's step kinds);
- inplace.mark_inplace: which steps may write their output over their input;
- reduce.apply_reduce: one of N data-parallel ranks' program (gradient buckets reduced across
  the ranks, the state sharded as ZeRO does), with the step kinds it adds in reduce_steps.py.

Each pass's docstring says what it reads and what it provides. A pass returns a new program
(or the same one, unchanged); none of them sets attributes on layers.
"""
