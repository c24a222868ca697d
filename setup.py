"""Builds cdcflow's optional C accelerator (cdcflow._speedups); everything else is
in pyproject.toml. Without a C compiler the install goes on without it, and cdcflow
decodes in pure Python (the same records, more slowly)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cdcflow._speedups",
            ["cdcflow/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
