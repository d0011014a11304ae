"""The ``fenced`` command line: a thin face that parses, calls the library and renders."""
