"""Twenty JSON schemas of the kinds clients send (nested objects, arrays, enums, bounded numbers,
required and optional fields, $defs, anyOf), each with a prompt that asks for such a value."""

SCHEMAS = [
    ("person", "Describe a person.", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}),
    ("city", "Tell me about Paris.", {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                         "population": {"type": "integer", "minimum": 0,
                                                        "maximum": 40000000}},
        "required": ["city", "country", "population"]}),
    ("sentiment", "Classify the sentiment of: 'I love this phone'.", {
        "type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]}),
    ("colors", "List three colors.", {
        "type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                    "minItems": 3, "maxItems": 3}},
        "required": ["colors"]}),
    ("boolean", "Is the sky blue?", {
        "type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string"}},
        "required": ["answer"]}),
    ("nested", "Describe a company and its address.", {
        "type": "object", "properties": {
            "company": {"type": "string"},
            "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["street", "city", "zip"]}},
        "required": ["company", "address"]}),
    ("order", "Write an order of two items.", {
        "type": "object", "properties": {
            "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                "type": "object", "properties": {"product": {"type": "string"},
                                                 "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["product", "quantity"]}}},
        "required": ["items"]}),
    ("rating", "Rate the movie Inception from 1 to 5.", {
        "type": "object", "properties": {"title": {"type": "string"},
                                         "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["title", "stars"]}),
    ("optional", "Give a book with an optional subtitle.", {
        "type": "object", "properties": {"title": {"type": "string"}, "subtitle": {"type": "string"},
                                         "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "year"]}),
    ("enum-list", "Which days are weekend days?", {
        "type": "object", "properties": {"days": {"type": "array", "maxItems": 7, "items": {
            "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}}},
        "required": ["days"]}),
    ("number", "What is 7 times 6?", {
        "type": "object", "properties": {"result": {"type": "number"}}, "required": ["result"]}),
    ("recipe", "Give a short pancake recipe.", {
        "type": "object", "properties": {
            "name": {"type": "string"},
            "ingredients": {"type": "array", "maxItems": 5, "items": {"type": "string", "maxLength": 30}},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 120}},
        "required": ["name", "ingredients", "minutes"]}),
    ("defs", "Describe two points on a plane.", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]}),
    ("any-of", "Give either an email or a phone contact.", {
        "type": "object", "properties": {"contact": {"anyOf": [
            {"type": "object", "properties": {"email": {"type": "string"}}, "required": ["email"]},
            {"type": "object", "properties": {"phone": {"type": "string"}}, "required": ["phone"]}]}},
        "required": ["contact"]}),
    ("nullable", "Who is the king of France today?", {
        "type": "object", "properties": {"king": {"type": ["string", "null"]}}, "required": ["king"]}),
    ("matrix", "Write a 2 by 2 matrix of small integers.", {
        "type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9,
                                                                     "maximum": 9}}}},
        "required": ["rows"]}),
    ("tags", "Tag the text 'Python is a programming language'.", {
        "type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                  "items": {"type": "string", "maxLength": 20}},
                                         "language": {"const": "en"}},
        "required": ["tags", "language"]}),
    ("event", "Plan a meeting.", {
        "type": "object", "properties": {
            "title": {"type": "string", "maxLength": 40},
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
            "hour": {"type": "integer", "minimum": 8, "maximum": 18},
            "attendees": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 20}, "required": {"type": "boolean"}},
                "required": ["name"]}}},
        "required": ["title", "day", "hour"]}),
    ("price", "What does a coffee cost?", {
        "type": "object", "properties": {"amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                                         "currency": {"enum": ["EUR", "USD", "GBP"]}},
        "required": ["amount", "currency"]}),
    ("top-level-array", "List two animals with their legs.", {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"animal": {"type": "string", "maxLength": 20},
                                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["animal", "legs"]}}),
]
