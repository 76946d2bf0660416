"""tailrace.engine: the roles (trainer, generator, reward server), the launcher and config. Imported
only as tailrace.engine; under a bare `engine` it steps aside (engine/_toplevel/_bare_names.py)."""

if "." not in __name__:  # imported as bare `engine` because the checkout's root is on sys.path
    import runpy  # by path: a checkout whose tailrace is not installed must step aside too
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "engine/_toplevel/_bare_names.py"))["step_aside"](__name__, __file__)
