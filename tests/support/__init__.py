"""What the tests share, in one package: test modules import from here, never from each other
(tests/test_layers.py pins it). Importing this package imports none of its modules.
"""
