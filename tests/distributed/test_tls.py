"""TLS credentials from PEM files, on real sockets: a server with a certificate and the
client that trusts its CA talk; a client trusting another CA, or (with mutual TLS) one
without a certificate of the right CA, is refused before any RPC runs."""

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tls_certs import issue, make_authority

from disttrain.core.channels import channel_credentials
from disttrain.core.errors import ConfigError
from disttrain.core.rpc_server import server_credentials
from disttrain.core.tls import TlsFiles

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pki(tmp_path):
    ca, other = make_authority(tmp_path, "ca"), make_authority(tmp_path, "other-ca")
    return {"ca": ca, "other": other, "server": issue(ca, tmp_path, "server"),
            "client": issue(ca, tmp_path, "client"), "stranger": issue(other, tmp_path, "stranger")}


def serve(files: TlsFiles):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(files))
    server.start()
    return server, f"127.0.0.1:{port}"


def check(address: str, files: TlsFiles) -> int:
    with grpc.secure_channel(address, channel_credentials(files)) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_client_trusting_the_servers_ca_connects_and_another_ca_is_refused(pki):
    cert, key = pki["server"]
    server, address = serve(TlsFiles(cert=str(cert), key=str(key)))
    try:
        assert check(address, TlsFiles(ca=str(pki["ca"].pem_path))) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            check(address, TlsFiles(ca=str(pki["other"].pem_path)))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.stop(0)


def test_mutual_tls_refuses_clients_without_a_certificate_of_the_ca(pki):
    cert, key = pki["server"]
    server, address = serve(TlsFiles(cert=str(cert), key=str(key), ca=str(pki["ca"].pem_path)))
    ca = str(pki["ca"].pem_path)
    try:
        client_cert, client_key = pki["client"]
        assert check(address, TlsFiles(cert=str(client_cert), key=str(client_key), ca=ca)) == \
            health_pb2.HealthCheckResponse.SERVING
        stranger_cert, stranger_key = pki["stranger"]
        for files in (TlsFiles(ca=ca), TlsFiles(cert=str(stranger_cert), key=str(stranger_key), ca=ca)):
            with pytest.raises(grpc.RpcError) as caught:
                check(address, files)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_bad_files_name_the_flag_and_the_file(tmp_path, pki):
    cert, key = pki["server"]
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        server_credentials(TlsFiles(cert=str(cert)))
    with pytest.raises(ConfigError, match=r"--tls-ca .*missing.pem: cannot be read"):
        channel_credentials(TlsFiles(ca=str(tmp_path / "missing.pem")))
    (tmp_path / "junk.pem").write_text("not a certificate")
    (tmp_path / "junk.pem").chmod(0o600)  # a key file must be private before its content counts
    with pytest.raises(ConfigError, match=r"--tls-key .*junk.pem: is not a PEM file"):
        server_credentials(TlsFiles(cert=str(cert), key=str(tmp_path / "junk.pem")))
    with pytest.raises(ConfigError, match="needs --tls-cert and --tls-key"):
        server_credentials(TlsFiles(ca=str(pki["ca"].pem_path)))
    assert not TlsFiles().enabled and TlsFiles(ca="x").enabled


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_private_key_others_may_read_is_refused_by_server_and_client(pki, mode):
    """One line naming the flag, the file and the fix, before any socket: a server's key
    and a client's (mutual TLS) alike."""
    cert, key = pki["server"]
    key.chmod(mode)
    expected = (rf"^--tls-key {key}: other users may read it \(mode [-rwx]+\); "
                rf"make it private with chmod 600 {key}$")
    with pytest.raises(ConfigError, match=expected):
        server_credentials(TlsFiles(cert=str(cert), key=str(key)))
    with pytest.raises(ConfigError, match=expected):
        channel_credentials(TlsFiles(ca=str(pki["ca"].pem_path), cert=str(cert), key=str(key)))
    key.chmod(0o600)
    server, address = serve(TlsFiles(cert=str(cert), key=str(key)))
    try:
        assert check(address, TlsFiles(ca=str(pki["ca"].pem_path))) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
