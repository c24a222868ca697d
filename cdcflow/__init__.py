"""cdcflow: read Google Cloud Spanner change streams with a small Python dataflow DSL."""

from cdcflow.pipeline import PCollection, Pipeline
from cdcflow.policy import ErrorPolicy

__version__ = "0.1.0"

__all__ = ["ErrorPolicy", "PCollection", "Pipeline", "__version__"]
