"""Tooling around the daemon, never on its import path: `kvbroker demo` (demo.py), `kvbroker bench`
(bench.py), broker processes for both and for the tests (launch.py), and the model shapes they and
the tests share (shapes.py). cli.py imports a tool only inside its command's branch."""
