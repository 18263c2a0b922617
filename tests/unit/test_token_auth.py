"""Token loading and the server interceptor's decision, without sockets."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import grpc
import pytest

from disttrain.cli.flags import token_from_args
from disttrain.core.auth import (
    REFUSED,
    TOKEN_ENV,
    TokenInterceptor,
    caller_of,
    check_token,
    new_token,
    read_token_file,
    resolve_token,
)
from disttrain.core.errors import ConfigError
from disttrain.core.identity import OPERATOR
from disttrain.core.secret_files import private_problem
from disttrain.training.options import RunOptions

TOKEN = "the-token"


def private_file(path, text: str):
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def test_a_token_file_is_read_and_stripped(tmp_path):
    assert read_token_file(private_file(tmp_path / "token", f"  {TOKEN}\n")) == TOKEN


@pytest.mark.parametrize("text", ["", " \n\t"])
def test_an_empty_token_file_is_an_error_naming_it(tmp_path, text):
    path = private_file(tmp_path / "token", text)
    with pytest.raises(ConfigError, match=f"--token-file {path}: the token is empty"):
        read_token_file(path)


@pytest.mark.parametrize("mode", [0o640, 0o604])
def test_a_token_file_others_may_read_is_refused(tmp_path, mode):
    path = private_file(tmp_path / "token", TOKEN)
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token_file(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_token_file_of_another_user_is_refused(tmp_path):
    path = private_file(tmp_path / "token", TOKEN)
    os.chown(path, 4242, 4242)
    with pytest.raises(ConfigError, match=rf"^--token-file {path}: it belongs to user 4242, not to the user "
                                          rf"reading it \(0\).*chmod 600 {path}$"):
        read_token_file(path)


@pytest.mark.parametrize(("mode", "owner", "reader", "problem"), [
    (0o600, 1000, 1000, None), (0o400, 1000, 1000, None), (0o600, 0, 1000, None),  # a mounted secret
    (0o640, 1000, 1000, "other users may read it"), (0o604, 0, 1000, "other users may read it"),
    (0o610, 1000, 1000, "other users may read it"), (0o600, 1001, 1000, "belongs to user 1001"),
    (0o600, 1000, 0, "belongs to user 1000"),  # root reads no other user's secret either
])
def test_a_secret_file_is_its_readers_own(mode, owner, reader, problem):
    found = private_problem(stat.S_IFREG | mode, owner, reader)
    assert (found is None) if problem is None else (problem in found and found.endswith("chmod 600"))


def test_a_missing_token_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=f"--token-file {tmp_path / 'absent'}: cannot read it"):
        read_token_file(tmp_path / "absent")


def test_a_token_with_spaces_or_non_ascii_is_refused():
    for bad in ("two words", "tökén"):
        with pytest.raises(ConfigError, match="printable ASCII"):
            check_token(bad, TOKEN_ENV)


def test_the_file_wins_over_the_environment_and_neither_means_open(tmp_path):
    path = private_file(tmp_path / "token", "from-file")
    assert resolve_token(str(path), "from-env") == "from-file"
    assert resolve_token(None, " from-env ") == "from-env"
    assert resolve_token(None, None) is None
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        resolve_token(None, "")
    assert token_from_args(SimpleNamespace(token_file=None), {TOKEN_ENV: "from-env"}) == "from-env"
    assert token_from_args(SimpleNamespace(token_file=None), {}) is None


def test_new_tokens_are_long_and_differ():
    first, second = new_token(), new_token()
    assert first != second and len(first) >= 43 and check_token(first, "new") == first


def test_the_token_stays_out_of_the_run_options_repr():
    assert TOKEN not in repr(RunOptions(token=TOKEN))


class Aborted(Exception):
    pass


class FakeContext:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


def intercept(method: str, metadata, handler=None):
    handler = handler or grpc.unary_unary_rpc_method_handler(lambda request, context: "ran")
    details = SimpleNamespace(method=method, invocation_metadata=metadata)
    return handler, TokenInterceptor(TOKEN).intercept_service(lambda _: handler, details)


def test_the_interceptor_passes_the_right_token_on_as_the_operator():
    _, chosen = intercept("/svc/Push", (("authorization", f"Bearer {TOKEN}"),))
    context = FakeContext()
    assert chosen.unary_unary("request", context) == "ran"  # the method's own behavior ran
    assert caller_of(context) == OPERATOR  # the holder of the run's secret


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                      (("other", f"Bearer {TOKEN}"),)])
def test_the_interceptor_refuses_without_running_the_handler(metadata):
    ran = []
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: ran.append(request))
    _, chosen = intercept("/svc/Push", metadata, handler)
    assert chosen is not handler
    context = FakeContext()
    with pytest.raises(Aborted):
        chosen.stream_unary(unread(), context)
    assert context.code == grpc.StatusCode.UNAUTHENTICATED and context.details == REFUSED and not ran


def unread():
    raise AssertionError("a refused call's request was read")
    yield  # a generator: the refusal must not start it


@pytest.mark.parametrize("make", [grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler,
                                  grpc.stream_unary_rpc_method_handler,
                                  grpc.stream_stream_rpc_method_handler])
def test_a_refusal_reads_no_request_and_answers_as_the_refused_call(make):
    """gRPC reads a unary request whole before its handler runs: a refusal is a
    request-streaming handler whatever the call's kind (the wire does not tell them
    apart), answering as the call does, its request never read."""
    handler = make(lambda request, context: None)
    _, chosen = intercept("/svc/Call", (), handler)
    assert (chosen.request_streaming, chosen.response_streaming) == (True, handler.response_streaming)
    behaviour = chosen.stream_unary or chosen.stream_stream
    context = FakeContext()
    with pytest.raises(Aborted):
        result = behaviour(unread(), context)
        list(result) if chosen.response_streaming else None
    assert context.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_checks_need_no_token():
    handler, chosen = intercept("/grpc.health.v1.Health/Check", ())
    assert chosen is handler
