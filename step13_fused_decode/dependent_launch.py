"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes (Hopper and later).

Even replayed from a CUDA graph, consecutive kernels leave a gap: the next kernel's programs are placed on
the multiprocessors only once the last program of the one before has exited, and a decode step of a 7B
model is some 240 kernels. Launched with PDL, the next kernel's programs are placed early, while the last
programs before them still run; each then waits (`griddepcontrol.wait`) until the kernel before it has
finished and its writes are visible. Every kernel that takes a `PDL` switch calls `wait_for_previous_kernel`
before it reads or writes anything, so it is as safe as an ordinary launch; what is saved is the time to
launch and place it. Right after the wait it lets the kernel after it launch early in turn
(`griddepcontrol.launch_dependents`).

Step 13 launches its own kernels this way (`--pdl`), and step 06's attention kernels through variants
that wait first and then run step 06's kernel bodies (`attention_pdl.py`); with the switch off the two
instructions are not compiled in. Order is kept along a chain: a kernel waits for the one before it, and
that one had waited for its own predecessor before it could finish. Kernels launched the ordinary way
(PyTorch's) wait for everything before them, as always. Triton's interpreter cannot run these
instructions, and GPUs before Hopper do not have them: there the engine leaves PDL off
(`FusedDecodeEngine.supports_pdl`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = True):
    """With `NEXT_EARLY` off, the kernel after this one is placed only once this one's programs exit (a
    measured choice where placing it early was slower: `FusedDecodeForward.rotate_and_attend`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if NEXT_EARLY:
            tl.extra.cuda.gdc_launch_dependents()
