from bench.loadtest.sse import SSEParser


def feed_all(parts):
    parser = SSEParser()
    events = []
    for part in parts:
        events += parser.feed(part)
    return events + parser.close()


def test_events_split_anywhere_give_the_same_result():
    stream = (
        'data: {"a": 1}\n\n: keep-alive\n\nevent: error\ndata: x\ndata: y\n\ndata: é\r\n\r\ndata:[DONE]\n\n'.encode()
    )
    want = [(None, '{"a": 1}'), ("error", "x\ny"), (None, "é"), (None, "[DONE]")]
    assert feed_all([stream]) == want
    for cut in range(1, len(stream)):  # every split point, also inside é and between \r and \n
        assert feed_all([stream[:cut], stream[cut:]]) == want, cut
    assert feed_all([bytes([b]) for b in stream]) == want


def test_cr_only_line_endings_and_missing_final_blank_line():
    assert feed_all([b"data: a\r\rdata: b"]) == [(None, "a"), (None, "b")]


def test_blank_lines_alone_make_no_event():
    assert feed_all([b"\n\n\r\n", b": comment\n\n"]) == []
