"""Authentication of client keys (protocol/SPEC.md, "Authentication (CURVE)"): with an allow-list, a client
whose key is not on it never completes the CURVE handshake, a key may say Hello only in its listed roles,
and a name held by one key cannot be taken over with another; the allow-list file is checked line by line.

Run: pytest tests/protocol/test_auth.py
"""

import pytest

from tailrace.protocol.transport import (
    Client,
    ConnectTimeout,
    Rejected,
    Server,
    generate_keypair,
    load_client_roles,
)

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


@pytest.fixture(scope="module")
def keys():
    return {name: generate_keypair() for name in ("server", "gen", "grader", "stranger")}


def client(server: Server, keys, who: str, role: str, name: str) -> Client:
    public, secret = keys[who]
    return Client(server.address, role=role, name=name, curve_server_key=keys["server"][0],
                  curve_public_key=public, curve_secret_key=secret)


async def test_only_listed_keys_join_and_only_in_their_roles(keys, tmp_path):
    allow = tmp_path / "clients.allow"
    allow.write_text(f"# run clients\n{keys['gen'][0].decode()} generator,tool\n"
                     f"{keys['grader'][0].decode()} reward  # the grader\n")
    roles = load_client_roles(allow)
    async with Server("tcp://127.0.0.1:0", run_id="r", curve_secret_key=keys["server"][1],
                      client_roles=roles) as server:
        async with client(server, keys, "gen", "generator", "gen-0") as gen:
            await gen.connect(timeout_s=WAIT_S)
            assert [p.key for p in server.peers.values()] == [keys["gen"][0].decode()]
            # The grader's key may not be a generator, nor take over the generator's name.
            for role, name, text in [("generator", "gen-1", "may not join as 'generator'"),
                                     ("reward", "gen-0", "held by another client key")]:
                async with client(server, keys, "grader", role, name) as other:
                    with pytest.raises(Rejected, match=text):
                        await other.connect(timeout_s=WAIT_S)
            async with client(server, keys, "grader", "reward", "grader") as grader:
                await grader.connect(timeout_s=WAIT_S)
        async with client(server, keys, "stranger", "generator", "gen-9") as stranger:
            with pytest.raises(ConnectTimeout):
                await stranger.connect(timeout_s=1.0)
        assert server._auth.num_refused >= 1 and "gen-9" not in [p.name for p in server.peers.values()]


def test_allow_list_files_are_checked(keys, tmp_path):
    path = tmp_path / "bad.allow"
    for text, error in [("notakey generator\n", "40-character"),
                        (f"{keys['gen'][0].decode()}\n", "expected"),
                        (f"{keys['gen'][0].decode()} trainer\n", "roles")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            load_client_roles(path)
    with pytest.raises(ValueError, match="needs curve_secret_key"):
        Server("tcp://127.0.0.1:0", run_id="r", client_roles={})
