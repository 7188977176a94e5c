//! Chat data: templates rendered and tokenized exactly as transformers' `apply_chat_template`
//! (fixtures of `scripts/make_chat_fixtures.py`), the formats of chat files, trained-token masks,
//! and the errors of bad data and bad templates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use models::tokenizer::Tokenizer;
use serde_json::Value as Json;
use train::chat::{
    read_conversations, read_preference_pairs, render_example, tokenize_conversation,
    tokenize_pair, tokenizer_files, ChatTemplate, Conversation, Message, TrainOn,
};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_model(&tokenizer_files(&fixtures().join("tokenizer"))).unwrap()
}

fn reference() -> Json {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn special_tokens() -> BTreeMap<String, String> {
    serde_json::from_value(reference()["special_tokens"].clone()).unwrap()
}

fn template(name: &str) -> ChatTemplate {
    ChatTemplate::from_file(
        &fixtures().join("templates").join(format!("{name}.jinja")),
        &special_tokens(),
    )
    .unwrap()
}

/// A fresh directory `name` under the test target's temporary directory.
fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("chat-{name}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn msgs(pairs: &[(&str, &str)]) -> Vec<Message> {
    pairs.iter().map(|(r, c)| Message::new(r, c)).collect()
}

#[test]
fn templates_render_and_tokenize_like_transformers() {
    let r = reference();
    let tok = tokenizer();
    let cases = r["cases"].as_array().unwrap();
    // 7 conversations (special-token text inside content and two user turns in a row among
    // them) x 5 templates x add_generation_prompt.
    assert_eq!(cases.len(), 70);
    let mut raised = 0;
    for case in cases {
        let (t, c, gen) = (
            case["template"].as_str().unwrap(),
            case["conversation"].as_str().unwrap(),
            case["add_generation_prompt"].as_bool().unwrap(),
        );
        let what = format!("template {t}, conversation {c}, add_generation_prompt={gen}");
        let messages: Vec<Message> = serde_json::from_value(r["conversations"][c].clone()).unwrap();
        let got = template(t).render(&messages, gen);
        if let Some(err) = case.get("error") {
            let e = got.expect_err(&what).to_string();
            assert!(e.contains(err.as_str().unwrap()), "{what}: {e}");
            assert!(e.contains(&format!("{t}.jinja")), "{what}: {e}");
            raised += 1;
            continue;
        }
        let text = got.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(text, case["text"].as_str().unwrap(), "{what}");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let (ids, offsets) = tok.encode_with_offsets(&text).unwrap();
        assert_eq!(ids, want, "{what}");
        // Offsets are byte ranges of the text, in order.
        assert!(offsets.iter().all(|&(s, e)| s <= e && e <= text.len()));
    }
    // The Llama-3 template on the system and tool turns, Mistral's on the tool turn and on two
    // user turns in a row.
    assert_eq!(raised, 8);
}

/// OpenAI content parts (`[{"type": "text", "text": ...}]`), read from a data file (the text
/// parts joined) and rendered by a template written for parts, give transformers' text and ids
/// for the parts themselves.
#[test]
fn content_parts_read_and_render_like_transformers() {
    let r = reference();
    let tok = tokenizer();
    let tpl = template("parts");
    let dir = fresh_dir("parts");
    let cases = r["parts_cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    for case in cases {
        let c = case["conversation"].as_str().unwrap();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let what = format!("parts conversation {c}, add_generation_prompt={gen}");
        let record = serde_json::json!({"messages": r["parts_conversations"][c]});
        let file = write(&dir, &format!("{c}.jsonl"), &record.to_string());
        let convs = read_conversations(&file, "--data").unwrap();
        let text = tpl.render(&convs[0].messages, gen).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{what}");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tok.encode_with_offsets(&text).unwrap().0, want, "{what}");
    }
    // A part that is not text is refused by name.
    let bad = write(
        &dir,
        "image.jsonl",
        r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, {"role": "assistant", "content": "a"}]}"#,
    );
    let e = read_conversations(&bad, "--data").unwrap_err().to_string();
    assert!(
        e.contains("only text content parts") && e.contains("image.jsonl"),
        "{e}"
    );
}

/// Special-token text inside a message is tokenized as those special tokens (as transformers
/// does), and the trained tokens of a reply holding it are still exactly the reply and its end
/// of turn; two user turns in a row render as transformers renders them but are refused as
/// training data, with the message named.
#[test]
fn special_token_text_in_content_and_repeated_roles() {
    let r = reference();
    let tok = tokenizer();
    let chatml = template("chatml");
    let messages: Vec<Message> =
        serde_json::from_value(r["conversations"]["special_in_content"].clone()).unwrap();
    let conv = Conversation {
        messages: messages.clone(),
        source: "special".into(),
    };
    let ex = tokenize_conversation(&chatml, &tok, &conv, SFT).unwrap();
    let case = r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["template"] == "chatml"
                && c["conversation"] == "special_in_content"
                && c["add_generation_prompt"] == false
        })
        .unwrap();
    let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
    assert_eq!(ex.ids, want, "the ids of transformers' apply_chat_template");
    let reply = format!("{}<|im_end|>\n", messages[1].content);
    assert_eq!(runs(&chatml, &conv, SFT), std::slice::from_ref(&reply));
    let im_end = tok.encode_with_offsets("<|im_end|>").unwrap().0;
    assert_eq!(im_end.len(), 1, "one special token");
    let trained: Vec<u32> = ex
        .ids
        .iter()
        .zip(&ex.trained)
        .filter(|p| *p.1)
        .map(|p| *p.0)
        .collect();
    assert_eq!(trained, tok.encode_with_offsets(&reply).unwrap().0);
    assert_eq!(
        trained[0], im_end[0],
        "the reply's <|im_end|> text is the special token"
    );

    let dir = fresh_dir("same-role");
    let record = serde_json::json!({"messages": r["conversations"]["same_role_twice"]});
    let file = write(&dir, "twice.jsonl", &record.to_string());
    let e = read_conversations(&file, "--data").unwrap_err().to_string();
    assert!(e.contains("twice.jsonl") && e.contains("message 1"), "{e}");
}

#[test]
fn model_templates_come_from_jinja_file_or_tokenizer_config() {
    let src = fixtures().join("tokenizer");
    let files = tokenizer_files(&src);
    assert!(ChatTemplate::from_model(&files).unwrap().is_none());

    let chatml = std::fs::read_to_string(fixtures().join("templates/chatml.jinja")).unwrap();
    let llama3 = std::fs::read_to_string(fixtures().join("templates/llama3.jinja")).unwrap();
    let mut cfg: Json =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap())
            .unwrap();
    let dir = fresh_dir("model-template");
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let conv = msgs(&[("user", "hi"), ("assistant", "yo")]);

    // A string in tokenizer_config.json, with its special tokens (llama3 writes bos_token).
    cfg["chat_template"] = Json::from(llama3.clone());
    write(&dir, "tokenizer_config.json", &cfg.to_string());
    let t = ChatTemplate::from_model(&tokenizer_files(&dir))
        .unwrap()
        .unwrap();
    assert_eq!(t.special_tokens()["bos_token"], "<s>");
    assert_eq!(
        t.render(&conv, false).unwrap(),
        "<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    );

    // A list of named templates: "default" is taken; without one, the names are listed.
    cfg["chat_template"] = serde_json::json!([
        {"name": "tool_use", "template": llama3},
        {"name": "default", "template": chatml},
    ]);
    write(&dir, "tokenizer_config.json", &cfg.to_string());
    let t = ChatTemplate::from_model(&tokenizer_files(&dir))
        .unwrap()
        .unwrap();
    assert!(t
        .render(&conv, false)
        .unwrap()
        .starts_with("<|im_start|>system\n"));
    cfg["chat_template"] = serde_json::json!([{"name": "tool_use", "template": "x"}]);
    write(&dir, "tokenizer_config.json", &cfg.to_string());
    let e = ChatTemplate::from_model(&tokenizer_files(&dir))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no template named \"default\"") && e.contains("tool_use"),
        "{e}"
    );

    // chat_template.jinja wins over tokenizer_config.json.
    write(
        &dir,
        "chat_template.jinja",
        "{{ messages[0]['content'] }}|{{ eos_token }}",
    );
    let t = ChatTemplate::from_model(&tokenizer_files(&dir))
        .unwrap()
        .unwrap();
    assert_eq!(t.render(&conv, false).unwrap(), "hi|</s>");
    assert!(t.name().ends_with("chat_template.jinja"));

    // A syntax error names the file and the line.
    write(
        &dir,
        "chat_template.jinja",
        "line one\n{% for m in messages %}{{ m }",
    );
    let e = ChatTemplate::from_model(&tokenizer_files(&dir))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chat_template.jinja") && e.contains("line 2"),
        "{e}"
    );
}

#[test]
fn builtin_templates() {
    let conv = msgs(&[("system", "S"), ("user", "U"), ("assistant", "A")]);
    let chatml = ChatTemplate::builtin("chatml", Some("</s>"), None).unwrap();
    assert_eq!(
        chatml.render(&conv, false).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n\
         <|im_start|>assistant\nA<|im_end|>\n"
    );
    assert_eq!(
        chatml.render(&conv[..2], true).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    );
    let plain = ChatTemplate::builtin("plain", Some("</s>"), Some("<s>")).unwrap();
    assert_eq!(
        plain.render(&conv, false).unwrap(),
        "<s>System: S\n\nUser: U\n\nAssistant: A</s>\n\n"
    );
    assert_eq!(
        plain.render(&conv[..2], true).unwrap(),
        "<s>System: S\n\nUser: U\n\nAssistant: "
    );
    let plain = ChatTemplate::builtin("plain", None, None).unwrap();
    assert_eq!(
        plain.render(&conv[1..], false).unwrap(),
        "User: U\n\nAssistant: A\n\n"
    );
    let e = ChatTemplate::builtin("vicuna", None, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("vicuna") && e.contains("chatml, plain"), "{e}");
}

/// Python's `json.dumps` semantics of transformers' `tojson`, and the other helpers.
#[test]
fn template_helpers() {
    let tpl = |src: &str| ChatTemplate::from_source(src, "t", &BTreeMap::new()).unwrap();
    let conv = msgs(&[("user", "a\"b\\c\n\u{e9}")]);
    let t = tpl("{{ messages[0] | tojson }}");
    assert_eq!(
        t.render(&conv, false).unwrap(),
        "{\"role\": \"user\", \"content\": \"a\\\"b\\\\c\\n\u{e9}\"}"
    );
    let t = tpl("{{ messages[0] | tojson(ensure_ascii=true, sort_keys=true) }}");
    assert_eq!(
        t.render(&conv, false).unwrap(),
        "{\"content\": \"a\\\"b\\\\c\\n\\u00e9\", \"role\": \"user\"}"
    );
    let t = tpl("{{ {'x': [1, 2.5, none, true], 'y': {}} | tojson(separators=(',', ':')) }}");
    assert_eq!(
        t.render(&conv, false).unwrap(),
        "{\"x\":[1,2.5,null,true],\"y\":{}}"
    );
    let t = tpl("{{ tools is none }}/{{ documents is none }}/{{ add_generation_prompt }}");
    // As Jinja2 prints booleans.
    assert_eq!(t.render(&conv, true).unwrap(), "True/True/True");
    let t = tpl("{{ strftime_now('%Y') | length }}");
    assert_eq!(t.render(&conv, false).unwrap(), "4");
    let t = tpl(
        "{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}\
         {{ m.content.upper().split('\\n') | join('|') }}{% endfor %}",
    );
    assert_eq!(t.render(&conv, false).unwrap(), "A\"B\\C|\u{c9}");
    assert_eq!(
        train::chat::strftime(
            "%Y-%m-%d %H:%M:%S %A %a %B %b %j %I %p %y %e %%",
            1_700_000_000
        ),
        "2023-11-14 22:13:20 Tuesday Tue November Nov 318 10 PM 23 14 %"
    );
    assert_eq!(
        train::chat::strftime("%Y-%m-%d %A", 0),
        "1970-01-01 Thursday"
    );
    assert_eq!(
        train::chat::strftime("%Y-%m-%d %j", 951_782_400),
        "2000-02-29 060"
    );
}

/// Runs of trained text (each maximal run of trained tokens, as text).
fn runs(tpl: &ChatTemplate, conv: &Conversation, train_on: TrainOn) -> Vec<String> {
    render_example(tpl, &tokenizer(), conv, train_on)
        .unwrap()
        .trained_runs()
}

const SFT: TrainOn = TrainOn {
    prompt: false,
    mask_history: false,
};

#[test]
fn formats_read_to_the_same_conversations() {
    let dir = fresh_dir("formats");
    let file = write(
        &dir,
        "mixed.jsonl",
        r#"{"instruction": "Translate", "input": "chat", "output": "cat", "system": "Be exact.", "history": [["Hi", "Hello"]]}
{"instruction": "Say hi", "input": "", "output": "hi"}

{"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}], "system": "Sys"}
{"messages": [{"role": "system", "content": "Sys"}, {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "text", "text": "1"}]}, {"role": "assistant", "content": "A1"}]}
"#,
    );
    let convs = read_conversations(&file, "--data").unwrap();
    assert_eq!(convs.len(), 4);
    assert_eq!(
        convs[0].messages,
        msgs(&[
            ("system", "Be exact."),
            ("user", "Hi"),
            ("assistant", "Hello"),
            ("user", "Translate\nchat"),
            ("assistant", "cat"),
        ])
    );
    assert_eq!(convs[0].source, format!("{} line 1", file.display()));
    assert_eq!(
        convs[1].messages,
        msgs(&[("user", "Say hi"), ("assistant", "hi")])
    );
    assert_eq!(
        convs[2].messages,
        msgs(&[
            ("system", "Sys"),
            ("user", "Q1"),
            ("assistant", "A1"),
            ("user", "Q2"),
            ("assistant", "A2"),
        ])
    );
    assert_eq!(convs[2].source, format!("{} line 4", file.display()));
    assert_eq!(
        convs[3].messages,
        msgs(&[("system", "Sys"), ("user", "Q1"), ("assistant", "A1")])
    );

    // A JSON array holds the same records.
    let records: Vec<Json> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let json = write(&dir, "mixed.json", &Json::from(records).to_string());
    let from_json = read_conversations(&json, "--data").unwrap();
    assert_eq!(from_json.len(), 4);
    for (a, b) in from_json.iter().zip(&convs) {
        assert_eq!(a.messages, b.messages);
    }
    assert_eq!(from_json[2].source, format!("{} item 2", json.display()));

    // Parquet (nested list<struct> column; ShareGPT as JSON text + a nullable system column)
    // gives the conversations of the JSON-lines file.
    let want = read_conversations(&fixtures().join("chat.jsonl"), "--data").unwrap();
    assert_eq!(want.len(), 3);
    for f in ["chat-nested.parquet", "chat-jsonstr.parquet"] {
        let got = read_conversations(&fixtures().join(f), "--data").unwrap();
        assert_eq!(got.len(), 3, "{f}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.messages, w.messages, "{f}");
        }
        assert!(got[1].source.ends_with(&format!("{f} row 1")), "{f}");
    }
}

/// Two questions, each answered (`hand line 1`).
fn two_turns() -> Conversation {
    Conversation {
        messages: msgs(&[
            ("user", "What is 2+2?"),
            ("assistant", "4"),
            ("user", "And 3+3?"),
            ("assistant", "6"),
        ]),
        source: "hand line 1".into(),
    }
}

#[test]
fn trained_tokens_are_the_replies_and_their_end_of_turn() {
    let tok = tokenizer();
    let chatml = template("chatml");
    let conv = two_turns();
    // Exact booleans: prompt tokens false, reply + <|im_end|> + newline true.
    let ex = tokenize_conversation(&chatml, &tok, &conv, SFT).unwrap();
    let enc = |s: &str| tok.encode_with_offsets(s).unwrap().0;
    let parts = [
        (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
             What is 2+2?<|im_end|>\n<|im_start|>assistant\n",
            false,
        ),
        ("4<|im_end|>\n", true),
        (
            "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n",
            false,
        ),
        ("6<|im_end|>\n", true),
    ];
    let mut want_ids = Vec::new();
    let mut want_trained = Vec::new();
    for (text, trained) in parts {
        let ids = enc(text);
        want_trained.extend(std::iter::repeat_n(trained, ids.len()));
        want_ids.extend(ids);
    }
    assert_eq!(ex.ids, want_ids);
    assert_eq!(ex.trained, want_trained);
    assert_eq!(ex.num_trained(), enc("4<|im_end|>\n").len() * 2);
    assert_eq!(ex.source, "hand line 1");

    // mask_history: only the last reply; train_on_prompt: everything.
    let last = TrainOn {
        prompt: false,
        mask_history: true,
    };
    assert_eq!(runs(&chatml, &conv, last), ["6<|im_end|>\n"]);
    let all = TrainOn {
        prompt: true,
        mask_history: false,
    };
    let ex = tokenize_conversation(&chatml, &tok, &conv, all).unwrap();
    assert!(ex.trained.iter().all(|&t| t));
    assert_eq!(ex.ids, want_ids);
    let both = TrainOn {
        prompt: true,
        mask_history: true,
    };
    assert!(tokenize_conversation(&chatml, &tok, &conv, both).is_err());

    // Other templates: the end-of-turn text each writes after the reply is trained.
    assert_eq!(
        runs(&template("llama3"), &conv, SFT),
        ["4<|eot_id|>", "6<|eot_id|>"]
    );
    assert_eq!(
        runs(&template("zephyr"), &conv, SFT),
        ["4</s>\n", "6</s>\n"]
    );
    // Mistral's prefix ends with " [/INST]\n"; the reply line starts with spaces.
    assert_eq!(
        runs(&template("mistral"), &conv, SFT),
        ["         4</s>\n", "         6</s>\n"]
    );
}

/// Phi-3's template (microsoft/Phi-3-mini-4k-instruct, also Phi-3.5-mini) closes a
/// conversation with `eos_token` when there is no generation prompt: every reply and its
/// `<|end|>` line are trained, the closing eos with the last reply only (it ends the whole
/// conversation), and the ids are those of the whole rendering.
#[test]
fn a_template_closing_with_eos_trains_every_reply() {
    let phi3 = ChatTemplate::from_source(
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + \
         message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + \
         message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}\
         {{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}\
         {% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
        "phi3.jinja",
        &special_tokens(),
    )
    .unwrap();
    let eos = special_tokens()["eos_token"].clone();
    let conv = two_turns();
    assert_eq!(
        runs(&phi3, &conv, SFT),
        ["4<|end|>\n".to_string(), format!("6<|end|>\n{eos}")]
    );
    let last = TrainOn {
        prompt: false,
        mask_history: true,
    };
    assert_eq!(runs(&phi3, &conv, last), [format!("6<|end|>\n{eos}")]);
    let ex = tokenize_conversation(&phi3, &tokenizer(), &conv, SFT).unwrap();
    let whole = phi3.render(&conv.messages, false).unwrap();
    assert_eq!(ex.ids, tokenizer().encode_with_offsets(&whole).unwrap().0);
}

#[test]
fn masks_of_each_file_format() {
    let dir = fresh_dir("masks");
    let file = write(
        &dir,
        "sft.jsonl",
        r#"{"instruction": "Add", "input": "1 2", "output": "3", "history": [["Hi", "Hello"]]}
{"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}], "system": "Sys"}
{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me look."}, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
"#,
    );
    let convs = read_conversations(&file, "--data").unwrap();
    let chatml = ChatTemplate::builtin("chatml", Some("</s>"), None).unwrap();
    let last = TrainOn {
        prompt: false,
        mask_history: true,
    };
    assert_eq!(
        runs(&chatml, &convs[0], SFT),
        ["Hello<|im_end|>\n", "3<|im_end|>\n"]
    );
    assert_eq!(runs(&chatml, &convs[0], last), ["3<|im_end|>\n"]);
    assert_eq!(
        runs(&chatml, &convs[1], SFT),
        ["A1<|im_end|>\n", "A2<|im_end|>\n"]
    );
    assert_eq!(
        runs(&chatml, &convs[2], SFT),
        ["Let me look.<|im_end|>\n", "Sunny.<|im_end|>\n"]
    );
    let all = TrainOn {
        prompt: true,
        mask_history: false,
    };
    let r = render_example(&chatml, &tokenizer(), &convs[1], all).unwrap();
    assert_eq!(r.trained_runs(), std::slice::from_ref(&r.text));
    assert!(r.text.starts_with("<|im_start|>system\nSys<|im_end|>\n"));

    // The plain template: the space after "Assistant:" merges into the reply's first token.
    let plain = ChatTemplate::builtin("plain", Some("</s>"), None).unwrap();
    let runs_plain = runs(&plain, &convs[1], SFT);
    assert_eq!(runs_plain.len(), 2);
    for (r, want) in runs_plain.iter().zip(["A1</s>\n\n", "A2</s>\n\n"]) {
        assert!(r.trim_start() == want, "{r:?}");
    }
}

#[test]
fn preference_pairs() {
    let dir = fresh_dir("pairs");
    let file = write(
        &dir,
        "dpo.jsonl",
        r#"{"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Rome."}
{"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello!"}, "rejected": {"from": "gpt", "value": "Go away."}, "system": "Be nice."}
{"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}], "chosen": [{"role": "assistant", "content": "6"}], "rejected": [{"role": "assistant", "content": "7"}]}
{"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "good"}], "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "bad"}]}
{"instruction": "Add", "input": "1 2", "chosen": "3", "rejected": "4"}
"#,
    );
    let pairs = read_preference_pairs(&file, "--data").unwrap();
    assert_eq!(pairs.len(), 5);
    assert_eq!(pairs[0].prompt, msgs(&[("user", "Capital of France?")]));
    assert_eq!(pairs[0].chosen, Message::new("assistant", "Paris."));
    assert_eq!(pairs[0].rejected, Message::new("assistant", "Rome."));
    assert_eq!(
        pairs[1].prompt,
        msgs(&[("system", "Be nice."), ("user", "Hi")])
    );
    assert_eq!(pairs[1].rejected.content, "Go away.");
    assert_eq!(pairs[2].prompt.len(), 3);
    assert_eq!(pairs[2].chosen.content, "6");
    assert_eq!(pairs[3].prompt, msgs(&[("user", "Q")]));
    assert_eq!(pairs[3].rejected.content, "bad");
    assert_eq!(pairs[4].prompt, msgs(&[("user", "Add\n1 2")]));
    assert_eq!(pairs[4].source, format!("{} line 5", file.display()));

    let tok = tokenizer();
    let chatml = template("chatml");
    let (c, r) = tokenize_pair(&chatml, &tok, &pairs[2]).unwrap();
    assert!(c.source.ends_with("line 3 (chosen)") && r.source.ends_with("line 3 (rejected)"));
    // Only the final reply is trained, not the earlier "4".
    let ids_of = |s: &str| tok.encode_with_offsets(s).unwrap().0;
    let reply = ids_of("6<|im_end|>\n");
    assert_eq!(c.num_trained(), reply.len());
    assert_eq!(c.ids[c.ids.len() - reply.len()..], reply);
    assert!(c.trained[c.ids.len() - reply.len()..].iter().all(|&t| t));
    let rejected = ids_of("7<|im_end|>\n");
    assert_eq!(r.ids[r.ids.len() - rejected.len()..], rejected);
    // The prompts are identical.
    assert_eq!(
        c.ids[..c.ids.len() - reply.len()],
        r.ids[..r.ids.len() - rejected.len()]
    );

    // Bad pairs name the line.
    let bad = write(
        &dir,
        "bad.jsonl",
        r#"{"prompt": "Q", "chosen": "a", "rejected": "b"}
{"prompt": "Q", "chosen": "a"}
"#,
    );
    let e = read_preference_pairs(&bad, "--data")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.jsonl") && e.contains("line 2") && e.contains("\"rejected\""),
        "{e}"
    );
    let bad = write(
        &dir,
        "bad2.jsonl",
        r#"{"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "chosen": "a", "rejected": "b"}
"#,
    );
    let e = read_preference_pairs(&bad, "--data")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 1") && e.contains("prompt ends with an assistant turn"),
        "{e}"
    );
}

/// Each bad record is an error naming the flag, the file and the line.
#[test]
fn bad_data_names_file_and_line() {
    let dir = fresh_dir("bad");
    let good = r#"{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}"#;
    let cases = [
        ("invalid-json", "{\"messages\": [", "not valid JSON"),
        (
            "wrong-roles",
            r#"{"messages": [{"role": "user", "content": "Q"}, {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A"}]}"#,
            "roles out of order",
        ),
        (
            "assistant-first",
            r#"{"conversations": [{"from": "gpt", "value": "A"}, {"from": "human", "value": "Q"}]}"#,
            "the first turn must be a user turn",
        ),
        (
            "late-system",
            r#"{"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}"#,
            "a system message may only come first",
        ),
        (
            "empty-turn",
            r#"{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "A"}]}"#,
            "message 0 (user): empty content",
        ),
        (
            "missing-field",
            r#"{"instruction": "Q"}"#,
            "missing string field \"output\"",
        ),
        (
            "missing-content",
            r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "A"}]}"#,
            "missing field \"content\"",
        ),
        (
            "unknown-role",
            r#"{"conversations": [{"from": "narrator", "value": "Q"}, {"from": "gpt", "value": "A"}]}"#,
            "unknown role \"narrator\"",
        ),
        (
            "no-reply",
            r#"{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]}"#,
            "ends with a user turn, not an assistant reply",
        ),
        (
            "unknown-format",
            r#"{"text": "plain text"}"#,
            "no \"messages\" (OpenAI), \"conversations\" (ShareGPT) or \"instruction\" (Alpaca)",
        ),
    ];
    for (name, line, want) in cases {
        let file = write(
            &dir,
            &format!("{name}.jsonl"),
            &format!("{good}\n\n{line}\n{good}\n"),
        );
        let e = read_conversations(&file, "--data").unwrap_err().to_string();
        assert!(
            e.starts_with("--data ")
                && e.contains(&format!("{name}.jsonl"))
                && e.contains("line 3")
                && e.contains(want),
            "{name}: {e}"
        );
    }
    // .json arrays name the item; other files are rejected by kind.
    let file = write(
        &dir,
        "items.json",
        &format!("[{good}, {{\"messages\": 3}}]"),
    );
    let e = read_conversations(&file, "--data").unwrap_err().to_string();
    assert!(e.contains("items.json") && e.contains("item 1"), "{e}");
    let file = write(&dir, "notes.txt", "hello");
    let e = read_conversations(&file, "--data").unwrap_err().to_string();
    assert!(e.contains("notes.txt") && e.contains(".jsonl"), "{e}");
    let file = write(&dir, "empty.jsonl", "\n");
    let e = read_conversations(&file, "--data").unwrap_err().to_string();
    assert!(e.contains("no records"), "{e}");
}

/// Template errors while tokenizing name the template and the example.
#[test]
fn template_errors_name_template_and_example() {
    let tok = tokenizer();
    let dir = fresh_dir("tpl-errors");
    let file = write(
        &dir,
        "tool.jsonl",
        r#"{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking."}, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
"#,
    );
    let conv = &read_conversations(&file, "--data").unwrap()[0];
    // The Llama-3 template raises on the tool turn.
    let e = tokenize_conversation(&template("llama3"), &tok, conv, SFT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("llama3.jinja")
            && e.contains("tool.jsonl line 1")
            && e.contains("Only user and assistant roles are supported"),
        "{e}"
    );

    let tpl = |src: &str| ChatTemplate::from_source(src, "custom.jinja", &BTreeMap::new()).unwrap();
    let conv = Conversation {
        messages: msgs(&[("user", "Q"), ("assistant", "A")]),
        source: "data.jsonl line 7".into(),
    };
    // No text for the replies: nothing to train.
    let silent = tpl(
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}",
    );
    let e = tokenize_conversation(&silent, &tok, &conv, SFT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.jsonl line 7") && e.contains("no trainable token"),
        "{e}"
    );
    // A template that rewrites the last turn is not prefix-stable.
    let unstable = tpl(
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.content }}{% endfor %}",
    );
    let e = tokenize_conversation(&unstable, &tok, &conv, SFT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("custom.jinja")
            && e.contains("data.jsonl line 7")
            && e.contains("prefix-stable"),
        "{e}"
    );
    // Runtime errors of the template itself.
    let e = tpl("{{ messages[0].content.nosuchmethod() }}")
        .render(&conv.messages, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("custom.jinja") && e.contains("nosuchmethod"),
        "{e}"
    );
    // Hand-built conversations are validated too.
    let bad = Conversation {
        messages: msgs(&[("assistant", "A")]),
        source: "built 1".into(),
    };
    let e = tokenize_conversation(&template("chatml"), &tok, &bad, SFT)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("built 1") && e.contains("first turn must be a user turn"),
        "{e}"
    );
}
