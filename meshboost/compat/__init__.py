"""ColossalAI's surface, in one package on the top floor: import paths, aliases and refusals.

Owns: every module that exists only so that a ColossalAI script runs after renaming `colossalai` ->
`meshboost`. The tree below mirrors ColossalAI's: the file `compat/<a>/<b>.py` is the module
`meshboost.<a>.<b>` (`compat/booster/plugin/` is `meshboost.booster.plugin`, `compat/logging.py` is
`meshboost.logging`, `compat/pipeline/stage_manager.py` is `meshboost.pipeline.stage_manager`).
`paths.py` serves them under those names (a finder that the top-level package installs); nothing
else is needed, and nothing patches another module.

Must not: be imported by any core package (tests/test_architecture.py checks it, ColossalAI paths
included: `meshboost.booster.plugin` is this package), hold an implementation of its own beyond a
thin view of meshboost or torch, or shadow a core module (a mirror file whose name a core module
already has would never be reached; the architecture test refuses one). Import these modules by
their ColossalAI names, never as `meshboost.compat.<...>` (that would load a second copy).
See docs/colossalai.md.
"""
