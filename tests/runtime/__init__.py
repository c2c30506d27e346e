"""Tests of kvtier.runtime: the facade, config, controller and TP agreement; one folder per part."""
