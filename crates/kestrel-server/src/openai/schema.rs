//! Closed objects: the JSON Schemas of tool parameters and `response_format`
//! are held to the properties they list.
//!
//! Plain JSON Schema allows any unlisted key unless a schema says
//! `additionalProperties: false`, and llguidance follows it: a small model
//! asked for `{city, unit}` may go on writing `"unit_type"`, `"unit_name"`,
//! ... until `max_tokens`. [`close_objects`] adds `additionalProperties:
//! false` to every object schema that lists `properties` and says nothing
//! about extra keys (vLLM's xgrammar backend generates in this strict mode
//! by default). A request's `plain_json_schema: true` keeps plain semantics.
//! Pure; one walk over the schema.

use serde_json::Value;

/// Keywords whose value is one subschema.
const ONE: &[&str] = &[
    "items",
    "additionalProperties",
    "contains",
    "additionalItems",
];
/// Keywords whose value is a list of subschemas.
const LIST: &[&str] = &["anyOf", "oneOf", "prefixItems", "items"];
/// Keywords whose value maps names to subschemas.
const MAP: &[&str] = &["properties", "patternProperties", "$defs", "definitions"];

/// `schema` with every object schema that lists `properties`, and says
/// nothing of `additionalProperties` or `unevaluatedProperties`, closed
/// (`additionalProperties: false`). Objects that merge through `allOf` are
/// left open (each branch lists only its share of the keys), as is
/// anything under `not`, `if`/`then`/`else` or `dependentSchemas`; their
/// own subschemas' properties are still closed.
pub fn close_objects(mut schema: Value) -> Value {
    close(&mut schema, true);
    schema
}

fn close(schema: &mut Value, may_close: bool) {
    let Value::Object(s) = schema else {
        return;
    };
    let merges = s.contains_key("allOf");
    if may_close
        && !merges
        && s.get("properties").is_some_and(Value::is_object)
        && !s.contains_key("additionalProperties")
        && !s.contains_key("unevaluatedProperties")
    {
        s.insert("additionalProperties".into(), Value::Bool(false));
    }
    for &k in ONE {
        if let Some(v) = s.get_mut(k).filter(|v| v.is_object()) {
            close(v, true);
        }
    }
    for &k in LIST {
        if let Some(Value::Array(list)) = s.get_mut(k) {
            list.iter_mut().for_each(|v| close(v, true));
        }
    }
    if let Some(Value::Array(list)) = s.get_mut("allOf") {
        list.iter_mut().for_each(|v| close(v, false));
    }
    for &k in MAP {
        if let Some(Value::Object(m)) = s.get_mut(k) {
            m.values_mut().for_each(|v| close(v, true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};

    /// An object schema with `properties` but no word on extra keys.
    fn is_open(s: &Map<String, Value>) -> bool {
        s.contains_key("properties") && !s.contains_key("additionalProperties")
    }

    #[test]
    fn listed_properties_close_and_explicit_choices_stay() {
        let s = close_objects(json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                "tags": {"type": "array", "items": {"properties": {"k": {}}}},
                "extra": {"type": "object", "properties": {"a": {}}, "additionalProperties": true},
                "typed": {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
                "any": {"type": "object"},
            },
            "$defs": {"d": {"properties": {"x": {}}}},
            "anyOf": [{"properties": {"y": {}}}],
        }));
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(
            s["properties"]["where"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(
            s["properties"]["tags"]["items"]["additionalProperties"],
            json!(false)
        );
        assert_eq!(
            s["properties"]["extra"]["additionalProperties"],
            json!(true)
        );
        assert_eq!(
            s["properties"]["typed"]["additionalProperties"],
            json!({"type": "integer"})
        );
        // No properties listed: any object (`json_object` mode) stays open.
        assert!(s["properties"]["any"].get("additionalProperties").is_none());
        assert_eq!(s["$defs"]["d"]["additionalProperties"], json!(false));
        assert_eq!(s["anyOf"][0]["additionalProperties"], json!(false));
    }

    #[test]
    fn merged_objects_stay_open_but_their_members_close() {
        let s = close_objects(json!({
            "allOf": [
                {"properties": {"a": {"type": "object", "properties": {"b": {}}}}},
                {"properties": {"c": {}}},
            ],
            "properties": {"a": {}},
        }));
        let open = |v: &Value| is_open(v.as_object().unwrap());
        assert!(open(&s));
        assert!(open(&s["allOf"][0]));
        assert!(open(&s["allOf"][1]));
        assert_eq!(
            s["allOf"][0]["properties"]["a"]["additionalProperties"],
            json!(false)
        );
    }

    #[test]
    fn non_schemas_pass_through() {
        for v in [
            json!(true),
            json!(false),
            json!({}),
            json!({"type": "string"}),
        ] {
            assert_eq!(close_objects(v.clone()), v);
        }
    }
}
