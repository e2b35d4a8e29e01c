"""Protobuf building blocks the resource builders share."""

from __future__ import annotations

from envoy.config.core.v3 import config_source_pb2
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message


def pack(message: Message) -> any_pb2.Any:
    """``message`` as a ``google.protobuf.Any`` (a ``typed_config``)."""
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def seconds(value: float) -> duration_pb2.Duration:
    """``value`` seconds as a ``Duration`` (to the nanosecond)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d


def ads_source() -> config_source_pb2.ConfigSource:
    """A resource that comes over the same ADS stream (v3)."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3
    )

