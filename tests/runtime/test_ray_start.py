"""What the main thread imports while Ray starts on its own thread registers no fork hook that pairs a lock."""

import subprocess
import sys
import textwrap

RECORD_PAIRED_HOOKS_WHILE_IMPORTING_TORCH = textwrap.dedent("""
    import os, sys
    import fedray.runtime.ray_start
    paired = []
    register = os.register_at_fork
    def recording(**hooks):
        if "before" in hooks and "after_in_parent" in hooks:
            paired.append(sys._getframe(1).f_code.co_filename)
        return register(**hooks)
    os.register_at_fork = recording
    import torch
    print(paired)
""")


def test_torch_s_import_registers_no_lock_taking_fork_hook_once_the_start_module_is_imported():
    """The main thread imports torch while the start thread forks Ray's processes: a hook registered between a fork's
    two halves releases a lock its first half never took (an "Exception ignored ... release unlocked lock" traceback
    in a refusal's output), so every such hook (logging's, concurrent.futures') is registered before, by ray_start."""
    done = subprocess.run([sys.executable, "-c", RECORD_PAIRED_HOOKS_WHILE_IMPORTING_TORCH], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
