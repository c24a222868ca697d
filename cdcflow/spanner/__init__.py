"""Reading Google Cloud Spanner. Only this package imports google-cloud-spanner (lazily)."""

from cdcflow.spanner.base import ChangeStreamClient, ChangeStreamQuery, StreamInfo

__all__ = ["ChangeStreamClient", "ChangeStreamQuery", "StreamInfo"]
