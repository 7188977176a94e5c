//! Chat data for fine-tuning: conversations and preference pairs read from JSON-lines, JSON or
//! Parquet files (Alpaca, ShareGPT and OpenAI formats), Hugging Face chat templates (Jinja,
//! rendered with minijinja the way transformers' `apply_chat_template` renders them), and the
//! tokenization of a conversation with a per-token mask of the trained (target) tokens.
//!
//! # Which tokens are trained
//!
//! The text of a conversation is the template's rendering of all its messages without a
//! generation prompt, tokenized without adding special tokens (the template writes them, as in
//! transformers). For each assistant turn `i`, the template renders `messages[..i]` with the
//! generation prompt (the prefix) and `messages[..=i]` without it; the assistant's span is the
//! text after the prefix up to the end of the longer rendering, so it holds the reply and what
//! the template writes after it (the end-of-turn token such as `<|im_end|>` or `</s>`, and a
//! newline after it), as LLaMA-Factory trains them. A token is trained when its bytes overlap
//! an assistant span (a token that straddles the border, e.g. a space merged with the reply's
//! first word, is trained). `trained[i] == true` means token `i` is a target: the loss predicts
//! it from the tokens before it (the caller shifts to labels).
//!
//! A template that closes a conversation with `eos_token` (Phi-3's, when there is no generation
//! prompt) writes it after the last turn only: an earlier turn's span ends before it. A template
//! for which the longer rendering does not start with the shorter one otherwise (one that
//! rewrites earlier turns, e.g. drops reasoning from past replies) is rejected for that
//! conversation: the spans would not be the text that is trained (`--mask-history`, the last
//! reply alone, still works).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, Value};
use models::hub::ModelFiles;
use models::tokenizer::Tokenizer;
use serde_json::Value as Json;

use crate::error::{Error, Result};

/// One chat message. Roles: `system`, `user`, `assistant`, and `tool` (a prompt turn, e.g. a
/// tool's result, in the place of a user turn).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A conversation to train on: an optional system message, then turns alternating between a
/// prompt (user first; later ones user or tool) and an assistant reply, ending with a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    pub messages: Vec<Message>,
    /// Where it comes from, for messages: `FILE line N` (JSON lines, from 1), `FILE item N`
    /// (JSON arrays, from 0) or `FILE row N` (Parquet, from 0).
    pub source: String,
}

/// One preference pair (DPO): a prompt conversation and two alternative final assistant
/// replies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreferencePair {
    /// System message (optional), then turns as in a [`Conversation`], ending with a prompt
    /// turn (user or tool).
    pub prompt: Vec<Message>,
    pub chosen: Message,
    pub rejected: Message,
    /// As [`Conversation::source`].
    pub source: String,
}

/// What LLaMA-Factory puts between an Alpaca record's `instruction` and its non-empty `input`.
pub const ALPACA_INPUT_SEPARATOR: &str = "\n";

// ---------------------------------------------------------------------------------------------
// Reading

/// The records of a data file with their labels (`line N`, `item N`, `row N`).
fn read_records(path: &Path, flag: &str) -> Result<Vec<(String, Json)>> {
    let err = |msg: String| Error::Data {
        flag: flag.into(),
        path: path.to_path_buf(),
        msg,
    };
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    let records = match ext.as_deref() {
        Some("parquet") => crate::data::read_parquet_rows(path)
            .map_err(err)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| (format!("row {i}"), v))
            .collect(),
        Some("jsonl") | Some("ndjson") => {
            let text =
                std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
            let mut records = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: Json = serde_json::from_str(line)
                    .map_err(|e| err(format!("line {}: not valid JSON: {e}", i + 1)))?;
                records.push((format!("line {}", i + 1), v));
            }
            records
        }
        Some("json") => {
            let text =
                std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
            let v: Json =
                serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
            match v {
                Json::Array(items) => items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| (format!("item {i}"), v))
                    .collect(),
                _ => return Err(err("expected a JSON array of records".into())),
            }
        }
        _ => {
            return Err(err(
                "unknown file kind; expected .jsonl, .ndjson, .json or .parquet".into(),
            ))
        }
    };
    if records.is_empty() {
        return Err(err("holds no records".into()));
    }
    Ok(records)
}

/// Reads conversations from `.jsonl`/`.ndjson` (one object per line), `.json` (an array of
/// objects) or `.parquet` (one row per record; columns holding strings, lists of structs, or
/// strings holding JSON). The format is detected per record:
///
/// - OpenAI: `messages`, a list of `{role, content}` (content a string or a list of
///   `{type: "text", text}` parts);
/// - ShareGPT: `conversations`, a list of `{from, value}` (`from` one of human/user,
///   gpt/assistant, system, observation/tool), plus an optional `system` string;
/// - Alpaca: `instruction`, optional `input` (appended to the instruction after
///   [`ALPACA_INPUT_SEPARATOR`] when non-empty, as LLaMA-Factory does), `output`, optional
///   `system` and optional `history` (`[[user, assistant], ...]`, turns before this one).
///
/// Errors ([`Error::Data`] naming `flag`, the file and the line, item or row): invalid JSON,
/// missing fields, an unknown role, empty content, roles out of order (after an optional system
/// message, user and assistant alternate, starting with user; a tool turn may take a later
/// user turn's place), a conversation not ending with an assistant turn, no records.
pub fn read_conversations(path: &Path, flag: &str) -> Result<Vec<Conversation>> {
    read_records(path, flag)?
        .into_iter()
        .map(|(label, rec)| {
            let messages = conversation_of(&rec)
                .and_then(|m| validate(&m).map(|()| m))
                .map_err(|msg| Error::Data {
                    flag: flag.into(),
                    path: path.to_path_buf(),
                    msg: format!("{label}: {msg}"),
                })?;
            Ok(Conversation {
                messages,
                source: format!("{} {label}", path.display()),
            })
        })
        .collect()
}

/// Reads preference pairs from the same file kinds as [`read_conversations`]. A record holds
/// `chosen` and `rejected` replies and a prompt:
///
/// - `prompt`: a string (one user turn) or a message list;
/// - or ShareGPT-style `conversations` (+ optional `system`), as LLaMA-Factory's DPO format;
/// - or OpenAI-style `messages`; or Alpaca-style `instruction` (+ `input`, `system`, `history`);
/// - or none of these, with `chosen` and `rejected` full conversations that share every message
///   but the last (TRL's implicit prompt).
///
/// `chosen` and `rejected` are each a string, one assistant message (`{role, content}` or
/// `{from, value}`), or a message list whose last message is the reply. Errors as
/// [`read_conversations`]; the prompt must end with a user (or tool) turn.
pub fn read_preference_pairs(path: &Path, flag: &str) -> Result<Vec<PreferencePair>> {
    read_records(path, flag)?
        .into_iter()
        .map(|(label, rec)| {
            let (prompt, chosen, rejected) = pair_of(&rec).map_err(|msg| Error::Data {
                flag: flag.into(),
                path: path.to_path_buf(),
                msg: format!("{label}: {msg}"),
            })?;
            Ok(PreferencePair {
                prompt,
                chosen,
                rejected,
                source: format!("{} {label}", path.display()),
            })
        })
        .collect()
}

type Msg<T> = std::result::Result<T, String>;

/// `v` itself, or the JSON a string holds when it is an array or an object (Parquet columns
/// written as JSON text).
fn unstring(v: &Json) -> std::borrow::Cow<'_, Json> {
    if let Json::String(s) = v {
        let t = s.trim_start();
        if t.starts_with('[') || t.starts_with('{') {
            if let Ok(parsed) = serde_json::from_str::<Json>(s) {
                if parsed.is_array() || parsed.is_object() {
                    return std::borrow::Cow::Owned(parsed);
                }
            }
        }
    }
    std::borrow::Cow::Borrowed(v)
}

fn object(rec: &Json) -> Msg<&serde_json::Map<String, Json>> {
    rec.as_object()
        .ok_or_else(|| format!("expected a JSON object, found {}", json_kind(rec)))
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// An optional string field (`null` counts as absent).
fn opt_str<'a>(obj: &'a serde_json::Map<String, Json>, key: &str) -> Msg<Option<&'a str>> {
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!(
            "field \"{key}\" must be a string, found {}",
            json_kind(v)
        )),
    }
}

fn req_str<'a>(obj: &'a serde_json::Map<String, Json>, key: &str) -> Msg<&'a str> {
    opt_str(obj, key)?.ok_or_else(|| format!("missing string field \"{key}\""))
}

/// The canonical role of a role name of any supported format.
fn canonical_role(name: &str) -> Option<&'static str> {
    Some(match name {
        "system" => "system",
        "user" | "human" => "user",
        "assistant" | "gpt" => "assistant",
        "tool" | "observation" => "tool",
        _ => return None,
    })
}

/// One message `{role, content}` or `{from, value}`; `what` names it in errors.
fn message_of(v: &Json, what: &str) -> Msg<Message> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("{what}: expected an object, found {}", json_kind(v)))?;
    let (role_key, content_key) = if obj.contains_key("from") || obj.contains_key("value") {
        ("from", "value")
    } else {
        ("role", "content")
    };
    let role = req_str(obj, role_key).map_err(|e| format!("{what}: {e}"))?;
    let role = canonical_role(role).ok_or_else(|| {
        format!(
            "{what}: unknown role {role:?} (expected system, user/human, assistant/gpt or \
             tool/observation)"
        )
    })?;
    let content = match obj.get(content_key) {
        Some(Json::String(s)) => s.clone(),
        // OpenAI content parts: the text parts, joined.
        Some(Json::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match p.get("text").and_then(|t| t.as_str()) {
                    Some(t) if p.get("type").and_then(|t| t.as_str()) == Some("text") => {
                        text.push_str(t)
                    }
                    _ => {
                        return Err(format!(
                            "{what}: only text content parts ({{\"type\": \"text\", \"text\": \
                             ...}}) are supported"
                        ))
                    }
                }
            }
            text
        }
        None | Some(Json::Null) => {
            return Err(format!("{what} ({role}): missing field \"{content_key}\""))
        }
        Some(v) => {
            return Err(format!(
                "{what} ({role}): field \"{content_key}\" must be a string, found {}",
                json_kind(v)
            ))
        }
    };
    Ok(Message {
        role: role.into(),
        content,
    })
}

/// A list of messages (field `key` of a record).
fn message_list(v: &Json, key: &str) -> Msg<Vec<Message>> {
    let v = unstring(v);
    let items = v.as_array().ok_or_else(|| {
        format!(
            "field \"{key}\" must be a list of messages, found {}",
            json_kind(&v)
        )
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, m)| message_of(m, &format!("{key}[{i}]")))
        .collect()
}

/// Prepends the record's `system` string (when non-empty) to `messages`.
fn with_system(
    obj: &serde_json::Map<String, Json>,
    mut messages: Vec<Message>,
) -> Msg<Vec<Message>> {
    if let Some(system) = opt_str(obj, "system")? {
        if !system.is_empty() {
            if messages.first().is_some_and(|m| m.role == "system") {
                return Err(
                    "both a \"system\" field and a system message; keep one of them".into(),
                );
            }
            messages.insert(0, Message::new("system", system));
        }
    }
    Ok(messages)
}

/// The prompt messages of an Alpaca record (system, history, instruction + input).
fn alpaca_prompt(obj: &serde_json::Map<String, Json>) -> Msg<Vec<Message>> {
    let mut messages = Vec::new();
    if let Some(h) = obj.get("history").filter(|h| !h.is_null()) {
        let h = unstring(h);
        let turns = h.as_array().ok_or_else(|| {
            "field \"history\" must be a list of [user, assistant] pairs".to_string()
        })?;
        for (i, t) in turns.iter().enumerate() {
            match t.as_array().map(|a| a.as_slice()) {
                Some([Json::String(q), Json::String(a)]) => {
                    messages.push(Message::new("user", q));
                    messages.push(Message::new("assistant", a));
                }
                _ => {
                    return Err(format!(
                        "history[{i}] must be a pair of strings [user, assistant]"
                    ))
                }
            }
        }
    }
    let mut query = req_str(obj, "instruction")?.to_string();
    if let Some(input) = opt_str(obj, "input")? {
        if !input.is_empty() {
            if !query.is_empty() {
                query.push_str(ALPACA_INPUT_SEPARATOR);
            }
            query.push_str(input);
        }
    }
    messages.push(Message::new("user", &query));
    with_system(obj, messages)
}

/// The messages of one conversation record (not yet validated).
fn conversation_of(rec: &Json) -> Msg<Vec<Message>> {
    let obj = object(rec)?;
    if let Some(v) = obj.get("messages") {
        with_system(obj, message_list(v, "messages")?)
    } else if let Some(v) = obj.get("conversations") {
        with_system(obj, message_list(v, "conversations")?)
    } else if obj.contains_key("instruction") {
        let mut messages = alpaca_prompt(obj)?;
        messages.push(Message::new("assistant", req_str(obj, "output")?));
        Ok(messages)
    } else {
        Err(
            "no \"messages\" (OpenAI), \"conversations\" (ShareGPT) or \"instruction\" (Alpaca) \
             field"
                .into(),
        )
    }
}

/// Checks the order of roles and that no content is empty: an optional system message, then
/// turns alternating between a prompt (user; later ones user or tool) and an assistant reply,
/// ending with the role `last` (assistant for conversations, a prompt role for DPO prompts).
fn validate_order(messages: &[Message], ends_with_reply: bool) -> Msg<()> {
    if messages.is_empty() {
        return Err("no messages".into());
    }
    for (i, m) in messages.iter().enumerate() {
        if canonical_role(&m.role) != Some(m.role.as_str()) {
            return Err(format!(
                "message {i}: unknown role {:?} (expected system, user, assistant or tool)",
                m.role
            ));
        }
        if m.content.trim().is_empty() {
            return Err(format!("message {i} ({}): empty content", m.role));
        }
    }
    let start = usize::from(messages[0].role == "system");
    if start == messages.len() {
        return Err("only a system message".into());
    }
    for (k, m) in messages[start..].iter().enumerate() {
        let i = start + k;
        let want_prompt = k % 2 == 0;
        let ok = match m.role.as_str() {
            "user" => want_prompt,
            "tool" => want_prompt && k > 0,
            "assistant" => !want_prompt,
            _ => false,
        };
        if !ok {
            let want = if m.role == "system" {
                "a system message may only come first".to_string()
            } else if k == 0 {
                "the first turn must be a user turn".to_string()
            } else if want_prompt {
                "expected a user turn after an assistant turn".to_string()
            } else {
                "expected an assistant turn (user and assistant must alternate)".to_string()
            };
            return Err(format!(
                "message {i} ({}): roles out of order: {want}",
                m.role
            ));
        }
    }
    let last = messages.last().map(|m| m.role.as_str()).unwrap_or_default();
    if ends_with_reply && last != "assistant" {
        return Err(format!(
            "the conversation ends with a {last} turn, not an assistant reply"
        ));
    }
    if !ends_with_reply && last == "assistant" {
        return Err("the prompt ends with an assistant turn, not a user turn".into());
    }
    Ok(())
}

fn validate(messages: &[Message]) -> Msg<()> {
    validate_order(messages, true)
}

/// A reply: a string, one message, or a list whose last message is the reply (the messages
/// before it returned too).
fn reply_of(v: &Json, key: &str) -> Msg<(Vec<Message>, Message)> {
    let v = unstring(v);
    let (mut before, reply) = match &*v {
        Json::String(s) => (Vec::new(), Message::new("assistant", s)),
        Json::Object(_) => (Vec::new(), message_of(&v, key)?),
        Json::Array(_) => {
            let mut list = message_list(&v, key)?;
            let reply = list
                .pop()
                .ok_or_else(|| format!("field \"{key}\" is an empty list"))?;
            (list, reply)
        }
        other => {
            return Err(format!(
                "field \"{key}\" must be a string, a message or a list of messages, found {}",
                json_kind(other)
            ))
        }
    };
    if reply.role != "assistant" {
        return Err(format!(
            "{key}: the reply is a {} message, not an assistant message",
            reply.role
        ));
    }
    if reply.content.trim().is_empty() {
        return Err(format!("{key}: empty reply"));
    }
    before.shrink_to_fit();
    Ok((before, reply))
}

fn pair_of(rec: &Json) -> Msg<(Vec<Message>, Message, Message)> {
    let obj = object(rec)?;
    let chosen = obj.get("chosen").ok_or("missing field \"chosen\"")?;
    let rejected = obj.get("rejected").ok_or("missing field \"rejected\"")?;
    let (chosen_before, chosen) = reply_of(chosen, "chosen")?;
    let (rejected_before, rejected) = reply_of(rejected, "rejected")?;
    let prompt = if let Some(p) = obj.get("prompt").filter(|p| !p.is_null()) {
        match &*unstring(p) {
            Json::String(s) => with_system(obj, vec![Message::new("user", s)])?,
            _ => with_system(obj, message_list(p, "prompt")?)?,
        }
    } else if let Some(v) = obj.get("conversations") {
        with_system(obj, message_list(v, "conversations")?)?
    } else if let Some(v) = obj.get("messages") {
        with_system(obj, message_list(v, "messages")?)?
    } else if obj.contains_key("instruction") {
        alpaca_prompt(obj)?
    } else if !chosen_before.is_empty() {
        if chosen_before != rejected_before {
            return Err(
                "no prompt field, and \"chosen\" and \"rejected\" differ before their last \
                 message (no shared prompt)"
                    .into(),
            );
        }
        chosen_before.clone()
    } else {
        return Err(
            "no prompt: expected a \"prompt\", \"conversations\", \"messages\" or \
             \"instruction\" field"
                .into(),
        );
    };
    validate_order(&prompt, false).map_err(|e| format!("prompt: {e}"))?;
    Ok((prompt, chosen, rejected))
}

// ---------------------------------------------------------------------------------------------
// Templates

/// The names of [`ChatTemplate::builtin`].
pub const BUILTIN_TEMPLATES: [&str; 2] = ["chatml", "plain"];

/// ChatML without a default system prompt (Qwen's adds one).
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ \
'<|im_start|>assistant\\n' }}{% endif %}";

/// `Role: content` blocks separated by blank lines; replies end with EOS.
const PLAIN: &str = "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}\
{% if message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + (eos_token or '') \
+ '\\n\\n' }}{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + '\\n\\n' }}\
{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}";

/// A compiled Hugging Face chat template with the special tokens it is given.
#[derive(Clone)]
pub struct ChatTemplate {
    name: String,
    source: String,
    special_tokens: BTreeMap<String, String>,
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

/// The special tokens of a `tokenizer_config.json` that transformers passes to chat templates
/// (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...: every `*_token` field holding a
/// string or an `{content}` object).
pub fn special_tokens(tokenizer_config: &Path) -> Result<BTreeMap<String, String>> {
    let cfg = read_json(tokenizer_config)?;
    Ok(special_tokens_of(&cfg))
}

fn special_tokens_of(cfg: &Json) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(obj) = cfg.as_object() {
        for (k, v) in obj {
            if !k.ends_with("_token") {
                continue;
            }
            let text = match v {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
                _ => None,
            };
            if let Some(t) = text {
                out.insert(k.clone(), t);
            }
        }
    }
    out
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Template {
        template: path.display().to_string(),
        msg: format!("not valid JSON: {e}"),
    })
}

impl ChatTemplate {
    /// The model's template: `chat_template.jinja` in the model directory, else
    /// `chat_template` in `tokenizer_config.json` (a string, or a list of `{name, template}` of
    /// which the one named `default` is taken), with the special tokens of
    /// `tokenizer_config.json` ([`special_tokens`]). `None` when the model has no template.
    pub fn from_model(files: &ModelFiles) -> Result<Option<Self>> {
        let cfg = match &files.tokenizer_config {
            Some(p) => Some((p, read_json(p)?)),
            None => None,
        };
        let tokens = cfg
            .as_ref()
            .map(|(_, c)| special_tokens_of(c))
            .unwrap_or_default();
        if let Some(path) = &files.chat_template {
            let source = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
            return Self::from_source(&source, &path.display().to_string(), &tokens).map(Some);
        }
        let Some((path, cfg)) = cfg else {
            return Ok(None);
        };
        let name = format!("{} (chat_template)", path.display());
        let bad = |msg: String| Error::Template {
            template: name.clone(),
            msg,
        };
        let source = match cfg.get("chat_template") {
            None | Some(Json::Null) => return Ok(None),
            Some(Json::String(s)) => s.clone(),
            Some(Json::Array(list)) => {
                let mut names = Vec::new();
                let mut found = None;
                for t in list {
                    let n = t.get("name").and_then(|n| n.as_str());
                    let src = t.get("template").and_then(|s| s.as_str());
                    match (n, src) {
                        (Some(n), Some(src)) => {
                            if n == "default" {
                                found = Some(src.to_string());
                            }
                            names.push(n.to_string());
                        }
                        _ => {
                            return Err(bad("list entries must be {name, template} strings".into()))
                        }
                    }
                }
                found.ok_or_else(|| {
                    bad(format!(
                        "has no template named \"default\" (templates: {})",
                        names.join(", ")
                    ))
                })?
            }
            Some(_) => return Err(bad("must be a string or a list of {name, template}".into())),
        };
        Self::from_source(&source, &name, &tokens).map(Some)
    }

    /// A built-in template for models without one (see [`BUILTIN_TEMPLATES`]):
    ///
    /// - `chatml`: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, generation prompt
    ///   `<|im_start|>assistant\n` (no default system prompt; the tokens are only special if the
    ///   tokenizer has them);
    /// - `plain`: `{bos}` when given, then `System: …\n\n`, `User: …\n\n`, `Tool: …\n\n` and
    ///   `Assistant: …{eos}\n\n` (EOS when given), generation prompt `Assistant: `.
    ///
    /// An unknown name is an error that lists the names.
    pub fn builtin(name: &str, eos_token: Option<&str>, bos_token: Option<&str>) -> Result<Self> {
        let source = match name {
            "chatml" => CHATML,
            "plain" => PLAIN,
            _ => {
                return Err(Error::Template {
                    template: name.into(),
                    msg: format!(
                        "no such built-in template (built-in: {})",
                        BUILTIN_TEMPLATES.join(", ")
                    ),
                })
            }
        };
        let mut tokens = BTreeMap::new();
        if let Some(t) = eos_token {
            tokens.insert("eos_token".to_string(), t.to_string());
        }
        if let Some(t) = bos_token {
            tokens.insert("bos_token".to_string(), t.to_string());
        }
        Self::from_source(source, &format!("built-in {name}"), &tokens)
    }

    /// A built-in template with the BOS and EOS tokens of `tok` (for models without a
    /// template).
    pub fn builtin_for(name: &str, tok: &Tokenizer) -> Result<Self> {
        let text = |id: Option<u32>| -> Result<Option<String>> {
            match id {
                Some(id) => Ok(Some(
                    tok.decode(&[id], models::tokenizer::SpecialTokens::Keep)?,
                )),
                None => Ok(None),
            }
        };
        let eos = text(tok.eos_token_id)?;
        let bos = text(tok.bos_token_id)?;
        Self::builtin(name, eos.as_deref(), bos.as_deref())
    }

    /// Compiles `source` (Jinja, as in `tokenizer_config.json`); `name` names it in errors;
    /// `special_tokens` (`bos_token`, `eos_token`, ...) are variables of the template. A syntax
    /// error is an error naming the template and the line.
    pub fn from_source(
        source: &str,
        name: &str,
        special_tokens: &BTreeMap<String, String>,
    ) -> Result<Self> {
        let mut env = environment();
        env.add_template_owned("chat_template", source.to_string())
            .map_err(|e| Error::Template {
                template: name.into(),
                msg: jinja_message(&e),
            })?;
        Ok(Self {
            name: name.into(),
            source: source.into(),
            special_tokens: special_tokens.clone(),
            env,
        })
    }

    /// A template file (`--chat-template FILE`) with the given special tokens.
    pub fn from_file(path: &Path, special_tokens: &BTreeMap<String, String>) -> Result<Self> {
        let source = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_source(&source, &path.display().to_string(), special_tokens)
    }

    /// The template a command uses: `spec` a built-in name ([`BUILTIN_TEMPLATES`]) or the path
    /// of a Jinja file (given the model's special tokens); without `spec`, the model's own
    /// ([`ChatTemplate::from_model`]), else an error saying to pass `flag chatml`.
    pub fn resolve(
        spec: Option<&str>,
        files: &ModelFiles,
        tok: &Tokenizer,
        flag: &str,
    ) -> Result<Self> {
        match spec {
            Some(name) if BUILTIN_TEMPLATES.contains(&name) => Self::builtin_for(name, tok),
            Some(path) => {
                let p = Path::new(path);
                if !p.is_file() {
                    return Err(Error::Template {
                        template: path.into(),
                        msg: format!(
                            "neither a built-in template ({}) nor a file",
                            BUILTIN_TEMPLATES.join(", ")
                        ),
                    });
                }
                let tokens = match &files.tokenizer_config {
                    Some(c) => special_tokens(c)?,
                    None => BTreeMap::new(),
                };
                Self::from_file(p, &tokens)
            }
            None => Self::from_model(files)?.ok_or_else(|| {
                Error::Invalid(format!(
                    "the model {} has no chat template (no chat_template.jinja, no chat_template \
                     in tokenizer_config.json); pass {flag} chatml (or {flag} plain, or a .jinja \
                     file)",
                    files.source
                ))
            }),
        }
    }

    /// What the template is called in messages (a path, or `built-in NAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special-token variables given to the template.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// Renders like transformers' `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`: the template sees `messages` (a list of `{role, content}`),
    /// `add_generation_prompt`, `tools` and `documents` (none), and the special tokens. An error
    /// of the template (`raise_exception(msg)`, an undefined operation) is
    /// [`Error::Template`] holding the template's message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_inner(messages, add_generation_prompt)
            .map_err(|msg| Error::Template {
                template: self.name.clone(),
                msg,
            })
    }

    /// Where the rendering `full` of a conversation's first turns ends inside the rendering
    /// `text` of the whole conversation: `full.len()` when `text` starts with `full`, or the
    /// length of `full` without a closing `eos_token` (and whitespace after it) that the
    /// template writes only at a conversation's end (Phi-3's templates close with
    /// `{{ eos_token }}` when there is no generation prompt). `None`: `full` is not a prefix.
    fn turn_end(&self, full: &str, text: &str) -> Option<usize> {
        if text.starts_with(full) {
            return Some(full.len());
        }
        let eos = self
            .special_tokens
            .get("eos_token")
            .filter(|e| !e.is_empty())?;
        let body = full.trim_end().strip_suffix(eos.as_str())?;
        text.starts_with(body).then_some(body.len())
    }

    fn render_inner(&self, messages: &[Message], add_generation_prompt: bool) -> Msg<String> {
        let tpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| jinja_message(&e))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        let mut ctx: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        ctx.push(("messages".into(), Value::from(messages)));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        ctx.push(("tools".into(), Value::from(())));
        ctx.push(("documents".into(), Value::from(())));
        let ctx = Value::from_pairs(ctx);
        tpl.render(ctx).map_err(|e| jinja_message(&e))
    }
}

/// The message of a minijinja error with the template line and its causes. Errors raised by
/// the template (`raise_exception(msg)`) are the template's message alone.
fn jinja_message(e: &minijinja::Error) -> String {
    let mut msg = match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        (kind, Some(d)) => format!("{kind}: {d}"),
        (kind, None) => kind.to_string(),
    };
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    msg
}

/// The Jinja environment of transformers' chat templates: `trim_blocks`, `lstrip_blocks`, loop
/// controls, Python string methods, `raise_exception`, `strftime_now` and transformers'
/// `tojson`.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // Infallible: these options take no user input.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime_now(&fmt)
    });
    env.add_filter("tojson", tojson_filter);
    env
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, without Jinja's HTML escaping.
fn tojson_filter(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let (item_sep, key_sep) = match separators.filter(|s| !s.is_none()) {
        Some(s) => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    python_json(&value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// `value` as Python's `json.dumps` writes it.
fn python_json(
    value: &Value,
    o: &JsonOpts,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined => {
            return Err(minijinja::Error::new(
                ErrorKind::UndefinedError,
                "tojson: the value is undefined",
            ))
        }
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                // Integers of any width print as themselves (i128/u128 included).
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => json_string(value.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Bytes => json_string(&value.to_string(), o.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (n, k) in keys.iter().enumerate() {
                if n > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None if k.is_none() => "null".to_string(),
                    None if k.kind() == ValueKind::Bool => {
                        (if k.is_true() { "true" } else { "false" }).to_string()
                    }
                    None => k.to_string(),
                };
                json_string(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                python_json(&value.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                python_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => json_string(&value.to_string(), o.ensure_ascii, out),
    }
    Ok(())
}

/// A float as Python's `repr` writes it (`1.0`, `0.5`, `1e-07`, `Infinity` in JSON).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let s = format!("{f}");
    if f.abs() >= 1e16 || (f != 0.0 && f.abs() < 1e-4) {
        // Python switches to exponent form: 1e-05, 1.5e+20.
        let e = format!("{f:e}");
        if let Some((m, x)) = e.split_once('e') {
            let x: i32 = x.parse().unwrap_or(0);
            let sign = if x < 0 { '-' } else { '+' };
            return format!("{m}e{sign}{:02}", x.abs());
        }
    }
    s
}

/// A JSON string literal as Python's `json.dumps` writes it.
fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The current UTC time formatted like Python's `datetime.strftime` (transformers uses local
/// time; UTC here): `%Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j %%`; other directives are
/// kept as written.
pub fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(fmt, secs)
}

/// `fmt` for the UTC time `secs` after the Unix epoch (see [`strftime_now`]).
pub fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (hour, min, sec) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{min:02}")),
            Some('S') => out.push_str(&format!("{sec:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Tokenization

/// Which tokens of a conversation are trained besides the assistant replies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainOn {
    /// `--train-on-prompt`: every token is trained (system and user turns too).
    pub prompt: bool,
    /// `--mask-history`: only the last assistant turn is trained.
    pub mask_history: bool,
}

/// A tokenized example: the ids of the rendered conversation and, per token, whether it is
/// trained (a target: predicted from the tokens before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedExample {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
    /// As [`Conversation::source`] (with ` (chosen)` / ` (rejected)` for preference pairs).
    pub source: String,
}

impl TokenizedExample {
    /// The number of trained tokens.
    pub fn num_trained(&self) -> usize {
        self.trained.iter().filter(|&&t| t).count()
    }
}

/// The byte ranges of the assistant turns in the rendering of all `messages` (only the last
/// one with `last_only`). See the module documentation.
fn assistant_spans(
    tpl: &ChatTemplate,
    messages: &[Message],
    text: &str,
    last_only: bool,
    source: &str,
) -> Result<Vec<std::ops::Range<usize>>> {
    let err = |msg: String| Error::Template {
        template: tpl.name.clone(),
        msg: format!("{source}: {msg}"),
    };
    let render = |m: &[Message], gen: bool| tpl.render_inner(m, gen).map_err(&err);
    let turns: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == "assistant")
        .map(|(i, _)| i)
        .collect();
    let turns = if last_only {
        turns.last().copied().into_iter().collect()
    } else {
        turns
    };
    let mut spans = Vec::with_capacity(turns.len());
    for i in turns {
        let prefix = render(&messages[..i], true)?;
        let full = render(&messages[..=i], false)?;
        if !full.starts_with(&prefix) {
            return Err(err(format!(
                "the template is not prefix-stable: the rendering of messages 0..={i} does not \
                 start with the rendering of messages 0..{i} with the generation prompt, so the \
                 reply of message {i} cannot be located"
            )));
        }
        let Some(end) = tpl.turn_end(&full, text) else {
            return Err(err(format!(
                "the template is not prefix-stable: the rendering of the whole conversation does \
                 not start with the rendering of messages 0..={i}, so the reply of message {i} \
                 cannot be located (--mask-history trains the last reply alone, which needs no \
                 earlier turn located)"
            )));
        };
        spans.push(prefix.len()..end);
    }
    Ok(spans)
}

/// Tokenizes `conv` rendered by `tpl` (tokenized without adding special tokens: the template
/// writes them) and marks its trained tokens: the tokens overlapping an assistant span (see
/// the module documentation); all tokens with `train_on.prompt`; only the last assistant
/// turn's with `train_on.mask_history`. Errors (naming `conv.source`): roles out of order or
/// empty content, a template error, a template that is not prefix-stable, both `prompt` and
/// `mask_history` (they contradict), and no trainable token.
pub fn tokenize_conversation(
    tpl: &ChatTemplate,
    tok: &Tokenizer,
    conv: &Conversation,
    train_on: TrainOn,
) -> Result<TokenizedExample> {
    Ok(render_example(tpl, tok, conv, train_on)?.example)
}

/// A tokenized example with the text it was tokenized from (for display: `cpl data render`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedExample {
    /// The template's rendering of the conversation.
    pub text: String,
    /// The byte range of `text` each token comes from.
    pub offsets: Vec<(usize, usize)>,
    pub example: TokenizedExample,
}

impl RenderedExample {
    /// The text of the trained tokens, as maximal runs of consecutive trained tokens.
    pub fn trained_runs(&self) -> Vec<String> {
        trained_runs(&self.text, &self.offsets, &self.example.trained)
    }
}

/// [`tokenize_conversation`], keeping the rendered text and the token offsets.
pub fn render_example(
    tpl: &ChatTemplate,
    tok: &Tokenizer,
    conv: &Conversation,
    train_on: TrainOn,
) -> Result<RenderedExample> {
    let source = &conv.source;
    if train_on.prompt && train_on.mask_history {
        return Err(Error::Invalid(
            "--train-on-prompt and --mask-history contradict each other (one trains the prompt, \
             the other masks earlier replies); choose one"
                .into(),
        ));
    }
    validate(&conv.messages).map_err(|msg| Error::Invalid(format!("{source}: {msg}")))?;
    let text = tpl
        .render_inner(&conv.messages, false)
        .map_err(|msg| Error::Template {
            template: tpl.name.clone(),
            msg: format!("{source}: {msg}"),
        })?;
    let (ids, offsets) = tok.encode_with_offsets(&text)?;
    let trained: Vec<bool> = if train_on.prompt {
        vec![true; ids.len()]
    } else {
        let spans = assistant_spans(tpl, &conv.messages, &text, train_on.mask_history, source)?;
        offsets
            .iter()
            .map(|&(s, e)| s < e && spans.iter().any(|r| s < r.end && e > r.start))
            .collect()
    };
    if !trained.iter().any(|&t| t) {
        return Err(Error::Invalid(format!(
            "{source}: no trainable token (the template renders no text for the assistant \
             replies)"
        )));
    }
    Ok(RenderedExample {
        text,
        offsets,
        example: TokenizedExample {
            ids,
            trained,
            source: source.clone(),
        },
    })
}

/// DPO: the prompt followed by the chosen reply, and by the rejected reply, each with only the
/// reply's tokens trained (the reply and the end-of-turn text the template writes after it).
/// Errors as [`tokenize_conversation`], naming the pair's source and which reply.
pub fn tokenize_pair(
    tpl: &ChatTemplate,
    tok: &Tokenizer,
    pair: &PreferencePair,
) -> Result<(TokenizedExample, TokenizedExample)> {
    let one = |reply: &Message, which: &str| {
        let mut messages = pair.prompt.clone();
        messages.push(reply.clone());
        let conv = Conversation {
            messages,
            source: format!("{} ({which})", pair.source),
        };
        tokenize_conversation(
            tpl,
            tok,
            &conv,
            TrainOn {
                prompt: false,
                mask_history: true,
            },
        )
    };
    Ok((
        one(&pair.chosen, "chosen")?,
        one(&pair.rejected, "rejected")?,
    ))
}

/// The text of `text`'s trained tokens, as maximal runs of consecutive trained tokens (for
/// display and tests): each run is the text from its first token's start to its last token's
/// end.
pub fn trained_runs(text: &str, offsets: &[(usize, usize)], trained: &[bool]) -> Vec<String> {
    let mut runs = Vec::new();
    let mut start: Option<usize> = None;
    let mut end = 0;
    for (k, (&(s, e), &t)) in offsets.iter().zip(trained).enumerate() {
        if t {
            if start.is_none() {
                start = Some(s);
            }
            end = e;
        }
        let closes = !t || k + 1 == offsets.len();
        if closes {
            if let Some(st) = start.take() {
                runs.push(text.get(st..end).unwrap_or_default().to_string());
            }
        }
    }
    runs
}

/// Path helper for tests and commands: a `ModelFiles`-like view of a directory holding only
/// tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`), without
/// weights.
pub fn tokenizer_files(dir: &Path) -> ModelFiles {
    let opt = |name: &str| {
        let p = dir.join(name);
        p.is_file().then_some(p)
    };
    ModelFiles {
        source: dir.display().to_string(),
        config: dir.join("config.json"),
        weights: Vec::<PathBuf>::new(),
        index: None,
        tokenizer: opt("tokenizer.json"),
        tokenizer_config: opt("tokenizer_config.json"),
        chat_template: opt("chat_template.jinja"),
        generation_config: opt("generation_config.json"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str) -> String {
        ChatTemplate::from_source(src, "t", &BTreeMap::new())
            .unwrap()
            .render(&[], false)
            .unwrap()
    }

    /// Numbers and strings as Python's `json.dumps` writes them.
    #[test]
    fn tojson_numbers_and_strings_are_pythons() {
        assert_eq!(render("{{ 2.0 | tojson }}"), "2.0");
        assert_eq!(render("{{ 3 | tojson }}"), "3");
        assert_eq!(render("{{ -0.25 | tojson }}"), "-0.25");
        assert_eq!(render("{{ 0.0000001 | tojson }}"), "1e-07");
        assert_eq!(
            render("{{ 'a\u{1}\u{7f}<>&' | tojson }}"),
            "\"a\\u0001\u{7f}<>&\""
        );
        assert_eq!(
            render("{{ '\u{1F600}' | tojson(ensure_ascii=true) }}"),
            "\"\\ud83d\\ude00\""
        );
        assert_eq!(
            render("{{ [[], {}, [1]] | tojson(indent=1) }}"),
            "[\n [],\n {},\n [\n  1\n ]\n]"
        );
    }

    #[test]
    fn roles_and_order() {
        let m = |pairs: &[(&str, &str)]| -> Vec<Message> {
            pairs.iter().map(|(r, c)| Message::new(r, c)).collect()
        };
        assert!(validate(&m(&[("user", "q"), ("assistant", "a")])).is_ok());
        assert!(validate(&m(&[
            ("system", "s"),
            ("user", "q"),
            ("assistant", "a"),
            ("tool", "t"),
            ("assistant", "b")
        ]))
        .is_ok());
        let e = validate(&m(&[("tool", "t"), ("assistant", "a")])).unwrap_err();
        assert!(e.contains("first turn must be a user turn"), "{e}");
        let e = validate(&m(&[("system", "s")])).unwrap_err();
        assert!(e.contains("only a system message"), "{e}");
        assert!(validate_order(&m(&[("user", "q")]), false).is_ok());
    }
}
