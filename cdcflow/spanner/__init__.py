"""Google Cloud Spanner: the change-stream reader and its decoder, the emulator launcher, the
Spanner metadata store and the shop workload. The only package that imports
google-cloud-spanner."""

from cdcflow.spanner.lookup import LookupRows

__all__ = ["LookupRows"]
