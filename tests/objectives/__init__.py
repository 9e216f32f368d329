"""Tests of jaxrl_llm.objectives, one file per module of the package."""
