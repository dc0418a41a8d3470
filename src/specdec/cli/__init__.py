"""The thin ``specdec`` command line: argument parsing only, everything else is a library call.
The top layer: may import every package.
"""
