"""A folder of ColossalAI paths inside the core package `meshboost.booster` (each file here is served as
`meshboost.booster.<file>` by compat/paths.py); never a module of its own: `meshboost.booster` is the core's."""
