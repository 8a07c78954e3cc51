"""A folder of ColossalAI paths inside the core package `meshboost.lazy` (each file here is served as
`meshboost.lazy.<file>` by compat/paths.py); never a module of its own: `meshboost.lazy` is the core's."""
