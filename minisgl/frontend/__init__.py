"""The front end: the `LLM` class (llm.py), the checks of prompts and sampling params
(validation.py), and the command line (cli.py, options.py).

It builds an `EngineConfig` (minisgl/config.py) and drives the core through `Scheduler`;
nothing in the core imports this package.
"""
