"""The `ucm bench` baseline of the `s3` driver: its client library called directly."""

from __future__ import annotations

from typing import Any

from ucm.block import PAYLOAD_OFFSET
from ucm.drivers._s3_client import resolve
from ucm.drivers.kit import safe_dir_name
from ucm.drivers.s3 import S3Driver


class RawS3:
    """boto3 called directly (one client, urllib3 pool) doing the driver's transfers: a PUT of
    a 4 KiB header plus the payload, a GET copied into the caller's buffer. No checksums."""

    label = "raw boto3 put/get"

    def __init__(self, options: dict[str, Any], namespace: str) -> None:
        import boto3
        from botocore.config import Config

        opts = S3Driver.Options.model_validate(options)
        target, credentials, _ = resolve(opts)
        frozen = credentials.get_frozen_credentials()
        self.client = boto3.client(
            "s3", endpoint_url=target.endpoint, region_name=target.region,
            aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key,
            aws_session_token=frozen.token,
            config=Config(s3={"addressing_style": opts.addressing_style},
                          max_pool_connections=opts.max_connections,
                          retries={"max_attempts": opts.max_attempts, "mode": "standard"}))
        self.bucket = target.bucket
        self.prefix = f"{opts.prefix.strip('/')}/raw-{safe_dir_name(namespace)}/"
        self.header = bytes(PAYLOAD_OFFSET)

    def store(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        for key, buf in zip(keys, bufs, strict=True):
            self.client.put_object(Bucket=self.bucket, Key=self.prefix + key.hex(),
                                   Body=self.header + buf)

    def load(self, keys: list[bytes], outs: list[memoryview], batch: int) -> None:
        for key, out in zip(keys, outs, strict=True):
            body = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key.hex())
            out[:] = memoryview(body["Body"].read())[PAYLOAD_OFFSET:]

    def delete(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), 1000):
            objects = [{"Key": self.prefix + k.hex()} for k in keys[i:i + 1000]]
            self.client.delete_objects(Bucket=self.bucket,
                                       Delete={"Objects": objects, "Quiet": True})

    def close(self) -> None:
        self.client.close()


def raw_baseline(options: dict[str, Any], namespace: str) -> RawS3:
    """For `ucm bench`: the raw client next to which the driver is measured."""
    return RawS3(options, namespace)

