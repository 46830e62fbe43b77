"""rlcheck inside a verl 0.9 run where verl's own plugin loading cannot be used: a Ray worker setup hook.

The usual way needs no recipe: rlcheck is a verl plugin (`rlcheck.integrations.verl.plugin`), loaded in
every verl process by verl itself (docs/integrations/verl.md):

    VERL_USE_EXTERNAL_MODULES=rlcheck.integrations.verl.plugin python -m verl.trainer.main_ppo ... \\
        +rlcheck.quarantine=true

Where the environment of verl's processes is not yours to set (a managed Ray cluster whose workers
start without it), Ray can import the plugin in every worker instead; the `rlcheck` section of verl's
config then turns it on:

    PYTHONPATH=$PWD/recipes python -m verl.trainer.main_ppo ... +rlcheck.run_dir=$PWD/runs/verl-gsm8k \\
        +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=verl_hook.install \\
        +ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH=$PWD/recipes

The plugin wraps verl's trainers as their modules are imported: the settings check and the static
preflight before the trainer starts its workers and vLLM, `rlcheck.integrations.verl.observe` on every
step right after the actor's recomputation of `old_log_probs`, rlcheck's metrics into verl's logger.
"""

from __future__ import annotations


def install() -> None:
    """Load rlcheck's verl plugin in this process (idempotent)."""
    from rlcheck.integrations.verl import plugin

    plugin.install()


if __name__ == "__main__":
    install()
    print("rlcheck's verl plugin installed: verl's trainers are wrapped when they are imported")
