"""A real S3-compatible object store for tests: moto's standalone server on 127.0.0.1 (a free port), a bucket, and
a multi-storage-client profile pointing at it with dummy credentials (``MSC_CONFIG``), so ``msc://PROFILE/...``
locations resolve to it in this process and in every process started with the same environment."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import yaml

BUCKET = "packtool-test"


@dataclass
class ObjectStore:
    """A running store: ``url(path)`` names an object of the test profile."""

    profile: str
    endpoint: str
    config: Path
    server: object

    def url(self, path: str = "") -> str:
        return f"msc://{self.profile}/{path}".rstrip("/")

    def env(self) -> dict[str, str]:
        return {"MSC_CONFIG": str(self.config)}

    def upload_tree(self, local: Path, path: str) -> str:
        """Put every file below ``local`` under ``path``; returns the folder's URL."""
        from packtool.storage import ObjectPath

        for f in sorted(local.rglob("*")):
            if f.is_file():
                ObjectPath(self.url(f"{path}/{f.relative_to(local).as_posix()}")).upload(f)
        return self.url(path)

    def digest(self, path: str) -> dict[str, str]:
        """sha256 of every object below ``path`` except the work files under ``.packtool/``."""
        from packtool.storage import ObjectPath

        root = ObjectPath(self.url(path))
        return {str(o.relative_to(root)): hashlib.sha256(o.read_bytes()).hexdigest()
                for o in sorted(root.files()) if ".packtool" not in o.relative_to(root).parts}

    def stop(self) -> None:
        self.server.stop()  # type: ignore[attr-defined]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder: Path, profile: str) -> ObjectStore:
    """Start the server, make the bucket, write the MSC config into ``folder`` and point ``MSC_CONFIG`` at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=BUCKET)
    config = folder / "msc_config.yaml"
    config.write_text(yaml.safe_dump({"profiles": {profile: {
        "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": endpoint,
                                                        "region_name": "us-east-1"}},
        "credentials_provider": {"type": "S3Credentials",
                                 "options": {"access_key": "testing", "secret_key": "testing"}},
    }}}))
    os.environ["MSC_CONFIG"] = str(config)
    return ObjectStore(profile, endpoint, config, server)
