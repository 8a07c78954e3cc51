"""A folder of ColossalAI paths inside the core package `meshboost.pipeline` (each file here is served as
`meshboost.pipeline.<file>` by compat/paths.py); never a module of its own: `meshboost.pipeline` is the core's."""
